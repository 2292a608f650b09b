"""Structured outputs in the engine (xgrammar): constrained and free requests share a
batch, the output always matches, the constraint survives preemption and prefix-cache
hits, ``max_tokens`` cuts give ``length``, dead ends end one request with an error, and
``logit_bias`` moves the logits."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured_output import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        engine.scheduler.check_integrity()
    return outs


def json_params(**kw):
    return SamplingParams(structured_outputs=SO(json=SO.schema_text(PERSON, "p")), **kw)


def test_json_schema_output_validates_while_free_requests_share_the_batch(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("Describe a person as JSON:")
    for i in range(4):
        engine.add_request(f"c{i}", prompt, json_params(max_tokens=120, temperature=1.0, seed=i))
    engine.add_request("free", tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=8, temperature=0))
    outs = drain(engine)
    assert outs["free"].output_text.startswith(" Paris")
    for i in range(4):
        o = outs[f"c{i}"]
        assert o.finish_reason == "stop", o.output_text
        jsonschema.validate(json.loads(o.output_text), PERSON)
    assert engine.scheduler.kv.pool.num_used == 0


@pytest.mark.parametrize(("so", "check"), [
    (SO(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    (SO(choice=("yes", "no", 'say "maybe"')), lambda t: t in ("yes", "no", 'say "maybe"')),
    (SO(grammar='root ::= "(" [a-c]+ ")"'), lambda t: re.fullmatch(r"\([a-c]+\)", t)),
    (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_object(make_engine, tokenizer, so, check):
    engine = make_engine()
    for seed in range(3):
        engine.add_request(f"r{seed}", tokenizer.encode("Answer:"),
                           SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured_outputs=so))
    for o in drain(engine).values():
        assert o.finish_reason == "stop" and check(o.output_text), o.output_text


def test_max_tokens_cut_reports_length_not_stop(make_engine, tokenizer):
    engine = make_engine()
    engine.add_request("cut", tokenizer.encode("JSON:"), json_params(max_tokens=3, temperature=0))
    o = drain(engine)["cut"]
    assert o.finish_reason == "length" and o.num_output_tokens == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(o.output_text)


def test_constraint_survives_preemption_and_prefix_cache_hits(make_engine, tokenizer):
    # 6 blocks of 16 tokens: four requests of ~45 tokens cannot all fit, so some are
    # preempted (recomputed) mid-output; all share the prompt (cache hits).
    engine = make_engine(num_gpu_blocks_override=6, max_num_batched_tokens=32)
    prompt = tokenizer.encode("Describe a person as JSON, with a name, an age and tags:")
    for i in range(4):
        engine.add_request(f"p{i}", prompt, json_params(max_tokens=60, temperature=0.8, seed=10 + i))
    outs = drain(engine)
    assert engine.scheduler.num_preemptions_total > 0
    for o in outs.values():
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.output_text), PERSON)
        else:
            assert o.finish_reason == "length"
    assert any(o.finish_reason == "stop" for o in outs.values())


def test_same_seed_same_constrained_output(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("JSON:")
    engine.add_request("a", prompt, json_params(max_tokens=80, temperature=1.0, seed=5))
    engine.add_request("b", prompt, json_params(max_tokens=80, temperature=1.0, seed=5))
    outs = drain(engine)
    assert outs["a"].output_token_ids == outs["b"].output_token_ids


def test_grammar_dead_end_ends_one_request_with_an_error_and_the_rest_finish(make_engine, tokenizer):
    engine = make_engine()
    # The choice is complete after its tokens; min_tokens forbids EOS: no token is left.
    engine.add_request("dead", tokenizer.encode("Answer:"),
                       SamplingParams(max_tokens=20, min_tokens=10, temperature=0, structured_outputs=SO(choice=("yes",))))
    engine.add_request("ok", tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=6, temperature=0))
    outs = drain(engine)
    assert outs["dead"].finish_reason == "abort"
    assert outs["dead"].error.startswith("structured_outputs: ") and "min_tokens" in outs["dead"].error
    assert outs["ok"].output_text.startswith(" Paris")
    assert engine.scheduler.kv.pool.num_used == 0


def test_reasoning_first_then_the_constraint(make_engine, tokenizer):
    # `after` is the reasoning parser's end marker (`</think>` in serving); here a text
    # the model writes on its own, so the free part is real model output.
    engine = make_engine()
    prompt = tokenizer.encode("The capital of France is")
    engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0,
                                                   structured_outputs=SO(choice=("OK",), after="Paris")))
    o = drain(engine)["r"]
    assert o.finish_reason == "stop"
    _, _, tail = o.output_text.partition("Paris")
    assert tail == "OK", o.output_text


def test_bad_constraints_are_refused_naming_the_field(make_engine, tokenizer):
    engine = make_engine()
    ids = tokenizer.encode("x")
    cases = [
        (SO(regex="(ab", param="guided_regex"), "guided_regex", "regular expression cannot be compiled"),
        (SO(grammar="root ::= foo", param="structured_outputs"), "structured_outputs", "Rule \"foo\" is not defined"),
        (SO(json='{"type": "wat"}', param="response_format"), "response_format", 'Unsupported type "wat"'),
    ]
    for so, param, text in cases:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", ids, SamplingParams(max_tokens=4, structured_outputs=so))
        assert e.value.param == param and text in str(e.value), str(e.value)
        assert "[" not in str(e.value).split(":")[0]  # xgrammar's time/file prefix is gone
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        SO(regex="a", choice=("b",))
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=SO(regex="a"))
    assert not engine.has_unfinished_requests()


def test_logit_bias_moves_the_logits(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("The capital of France is")
    target = tokenizer.encode(" banana")[0]
    engine.add_request("forced", prompt, SamplingParams(max_tokens=3, temperature=0, logit_bias={target: 100}))
    paris = tokenizer.encode(" Paris")[0]
    engine.add_request("banned", prompt, SamplingParams(max_tokens=1, temperature=0, logit_bias={paris: -100}))
    outs = drain(engine)
    assert outs["forced"].output_token_ids == [target] * 3
    assert outs["banned"].output_token_ids[0] != paris
    with pytest.raises(InvalidRequestError, match=r"logit_bias: token id 60000 is outside the vocabulary"):
        engine.add_request("oov", prompt, SamplingParams(max_tokens=1, logit_bias={60000: 1.0}))
    with pytest.raises(InvalidRequestError, match=r"logit_bias must be a bias in \[-100, 100\], got 101"):
        SamplingParams(logit_bias={1: 101})


def test_prompt_logprobs_are_teacher_forced_and_chunking_does_not_change_them(make_engine, tokenizer):
    prompt = tokenizer.encode("The capital of France is Paris, and the capital of Italy is Rome.")
    runs = {}
    for budget in (2048, 8):  # one chunk; many chunks of 8
        engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=4)
        # A cached copy of the prompt first: prompt logprobs must not take it from the cache.
        engine.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0))
        drain(engine)
        engine.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
        out = drain(engine)["p"]
        runs[budget] = out
        assert out.num_cached_tokens == 0
    a, b = runs[2048].prompt_logprobs, runs[8].prompt_logprobs
    assert len(a) == len(prompt) - 1
    for (lp_a, rank_a, top_a), (lp_b, rank_b, top_b) in zip(a, b, strict=True):
        assert abs(lp_a - lp_b) < 1e-3 and rank_a == rank_b and [t for t, _ in top_a] == [t for t, _ in top_b]
        assert len(top_a) == 3 and top_a[0][1] >= lp_a and (rank_a == 1) == (top_a[0][1] == lp_a)
    # Teacher forcing: the best token after prompt[: i + 1] is what greedy decoding picks there.
    engine = make_engine()
    for i in (2, 6, 11):
        engine.add_request(f"g{i}", prompt[: i + 1], SamplingParams(max_tokens=1, temperature=0, logprobs=0))
    outs = drain(engine)
    for i in (2, 6, 11):
        greedy = outs[f"g{i}"]
        assert greedy.output_token_ids[0] == a[i][2][0][0]
        assert abs(a[i][2][0][1] - greedy.new_logprobs[0].logprob) < 1e-3
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
