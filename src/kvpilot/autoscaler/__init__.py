"""Scaling policy and fleet simulator. Standard library only: the policy is a pure
function of its inputs (the clock is passed in), so anyone can test it."""
