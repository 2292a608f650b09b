"""Prompts used by the model-level tests: diverse topics, lengths and scripts."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Translate to French: I like apples. ->",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Q: What is 12 times 7?\nA:",
    "The mitochondria is the powerhouse of the cell because",
    "List of planets in the solar system: Mercury, Venus,",
    "In 1969, Neil Armstrong",
]

SYSTEM_PREFIX = (
    "You are a meticulous assistant for a logistics company. Always answer briefly, cite the "
    "warehouse code when you know it, and never invent shipment numbers. The warehouses are "
    "AMS-1 in Amsterdam, BER-2 in Berlin, and LIS-3 in Lisbon. Office hours are 8 to 18.\n\n"
)

QUESTIONS = [
    "Where is BER-2?",
    "What are the office hours?",
    "Which warehouse is in Lisbon?",
    "Can you give me a shipment number?",
    "How many warehouses are there?",
    "Is AMS-1 in Germany?",
    "Summarize your instructions.",
    "What city hosts the LIS-3 warehouse?",
]
