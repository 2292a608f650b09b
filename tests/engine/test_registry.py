"""The pick-by-name registry (kvpilot.engine.registry) behind --tool-call-parser,
--reasoning-parser and --attention-backend."""

from __future__ import annotations

import pytest

from kvpilot.engine.registry import Registry


def test_register_get_and_the_mapping_view():
    reg: Registry[type] = Registry("widget")

    @reg.register("b")
    class B:
        pass

    reg.register("a")(int)
    assert reg.get("b") is B and reg["a"] is int
    assert reg.names() == ("b", "a") == tuple(reg)  # registration order, not sorted
    assert "a" in reg and "c" not in reg and len(reg) == 2
    assert dict(reg) == {"b": B, "a": int} and reg.items() == [("b", B), ("a", int)]


def test_unknown_names_say_what_is_allowed():
    reg: Registry[type] = Registry("widget")
    reg.register("x")(int)
    reg.register("y")(str)
    with pytest.raises(ValueError, match=r"^unknown widget 'z'; expected one of: x, y$"):
        reg.get("z")
    with pytest.raises(KeyError):
        reg["z"]
    custom: Registry[type] = Registry("gadget", unknown="no {kind} {name!r} (try auto, {allowed})")
    custom.register("x")(int)
    assert str(custom.unknown("q")) == "no gadget 'q' (try auto, x)"


def test_a_name_is_registered_once():
    reg: Registry[type] = Registry("widget")
    reg.register("x")(int)
    with pytest.raises(ValueError, match="'x' is registered twice"):
        reg.register("x")(str)
    with pytest.raises(ValueError, match="'x' is registered twice"):
        reg.register_lazy("x", "json:loads")


def test_lazy_entries_import_on_first_use():
    reg: Registry[object] = Registry("codec")
    reg.register_lazy("json", "json:JSONDecoder")
    reg.register_lazy("missing", "kvpilot_no_such_module:Thing")
    assert "missing" in reg  # nothing imported yet
    import json

    assert reg.get("json") is json.JSONDecoder
    with pytest.raises(ValueError, match=r"^codec 'missing' is not available here: "):
        reg.get("missing")
    with pytest.raises(ValueError, match="not 'module:attribute'"):
        reg.register_lazy("bad", "json.loads")


def test_the_attention_backends_keep_their_names_and_message():
    torch = pytest.importorskip("torch")
    from kvpilot.engine.attention.backend import ATTENTION_BACKENDS, resolve_backend_name

    assert ATTENTION_BACKENDS.names() == ("torch", "cpu", "triton")
    with pytest.raises(ValueError, match=r"^unknown attention backend 'flash'; choose one of: "
                                         r"auto, torch, cpu, triton$"):
        resolve_backend_name("flash", torch.device("cpu"))
