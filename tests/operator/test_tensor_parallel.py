"""engine.tensorParallelSize and engine.shmSize: the default from the pod's GPUs, the
refusals (the operator's parser and the CRD's CEL rules agree), ``--tensor-parallel-size``
on every engine command line, and the sized ``/dev/shm`` of tensor-parallel pods."""

from __future__ import annotations

import copy
import itertools

import kubernetes_validate
import pytest

from kvpilot.engine.config import EngineArgs
from kvpilot.operator import constants as c
from kvpilot.operator.builders import Owner, build_children
from kvpilot.operator.builders.engine_args import engine_args
from kvpilot.operator.spec import SpecError, gpu_count, parse_spec
from kvpilot.operator.spec.engine import DEFAULT_SHM_SIZE, KV_CACHE_DTYPES

from .crdschema import admit, load_crd

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
DIVIDE = "engine.tensorParallelSize must divide the pod's GPU count"


@pytest.fixture(scope="module")
def crd():
    return load_crd()


def spec(resources: dict | None = None, **engine) -> dict:
    out: dict = {"model": dict(EMBEDDED), "engine": engine}
    if resources is not None:
        out["resources"] = resources
    return out


def obj(spec_: dict) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": "chat", "namespace": "llm"}, "spec": copy.deepcopy(spec_)}


def tp_arg(args: list[str]) -> str:
    """The value of --tensor-parallel-size; it must come exactly once."""
    assert args.count("--tensor-parallel-size") == 1, args
    return args[args.index("--tensor-parallel-size") + 1]


def pod_of(spec_: dict) -> dict:
    children = build_children(Owner("chat", "llm", "uid"), parse_spec(spec_), 1, "img", False)
    return children.deployment["spec"]["template"]["spec"]


def dshm(pod: dict) -> tuple[dict | None, dict | None]:
    """(the dshm volume, its mount in the engine container), None where absent."""
    volume = next((v for v in pod["volumes"] if v["name"] == "dshm"), None)
    (engine,) = pod["containers"]
    mount = next((m for m in engine["volumeMounts"] if m["name"] == "dshm"), None)
    return volume, mount


# ------------------------------------------------------------------ the default
DEFAULTS = [
    ("cpu", None, 1, "cpu"),
    ("cpu-with-memory-only", {"limits": {"cpu": "2", "memory": "4Gi"}}, 1, "cpu"),
    ("one-gpu", {"limits": {"nvidia.com/gpu": 1}}, 1, "cuda"),
    ("four-gpus", {"limits": {"nvidia.com/gpu": 4}}, 4, "cuda"),
    ("four-gpus-written-as-a-string", {"limits": {"nvidia.com/gpu": "4"}}, 4, "cuda"),
    ("eight-amd-gpus-requested-only", {"requests": {"amd.com/gpu": 8}}, 8, "cuda"),
    ("the-limit-wins-over-the-request",
     {"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 4}}, 4, "cuda"),
    ("another-vendors-gpu", {"limits": {"gpu.example.com/gpu": 2}}, 2, "cuda"),
    ("a-mig-slice", {"limits": {"nvidia.com/mig-1g.10gb": 1}}, 1, "cuda"),
    ("two-mig-slices", {"limits": {"nvidia.com/mig-3g.40gb": 2}}, 1, "cuda"),
    ("zero-gpus", {"limits": {"nvidia.com/gpu": 0}}, 1, "cpu"),
]


@pytest.mark.parametrize("case,resources,expected,device", DEFAULTS, ids=[d[0] for d in DEFAULTS])
def test_the_default_is_the_pods_whole_gpu_count(crd, case, resources, expected, device):
    s = spec(resources)
    assert admit(crd, obj(s))[1] == []
    parsed = parse_spec(s)
    assert parsed.engine.tensor_parallel_size == expected
    args = engine_args(parsed)
    assert tp_arg(args) == str(expected)
    # Written right after --device, before the flags that follow it.
    assert args[args.index("--device") + 1: args.index("--device") + 4] == [
        device, "--tensor-parallel-size", str(expected)]


def test_gpu_count_sums_whole_gpus_and_ignores_mig_slices():
    assert gpu_count({}) == 0
    assert gpu_count({"limits": {"nvidia.com/gpu": "2", "memory": "8Gi"}}) == 2
    assert gpu_count({"limits": {"nvidia.com/mig-1g.10gb": 7}}) == 0
    assert gpu_count({"requests": {"amd.com/gpu": 3}, "limits": {"cpu": 4}}) == 3


@pytest.mark.parametrize("resources,tp", [
    ({"limits": {"nvidia.com/gpu": 4}}, 4),
    ({"limits": {"nvidia.com/gpu": 4}}, 2),
    ({"limits": {"nvidia.com/gpu": 4}}, 1),
    ({"limits": {"nvidia.com/gpu": 8}}, 8),
    ({"requests": {"amd.com/gpu": "6"}}, 3),
    # A CPU pod may run tensor-parallel workers (gloo): for tests.
    (None, 2),
    ({"limits": {"cpu": "4", "memory": "8Gi"}}, 4),
])
def test_an_explicit_size_is_written_as_given(crd, resources, tp):
    s = spec(resources, tensorParallelSize=tp)
    assert admit(crd, obj(s))[1] == []
    parsed = parse_spec(s)
    assert parsed.engine.tensor_parallel_size == tp
    assert tp_arg(engine_args(parsed)) == str(tp)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("resources,tp,divisors", [
    ({"limits": {"nvidia.com/gpu": 4}}, 3, "1, 2, 4"),
    ({"limits": {"nvidia.com/gpu": 4}}, 8, "1, 2, 4"),
    ({"limits": {"nvidia.com/gpu": "6"}}, 4, "1, 2, 3, 6"),
    ({"requests": {"amd.com/gpu": 2}}, 3, "1, 2"),
    ({"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 2}}, 4, "1, 2"),
])
def test_a_size_that_does_not_divide_the_gpus_is_refused(crd, resources, tp, divisors):
    s = spec(resources, tensorParallelSize=tp)
    _, errors = admit(crd, obj(s))
    assert errors == [f"spec: {DIVIDE} (the nvidia.com/gpu or amd.com/gpu quantity in"
                      " resources.limits, else requests): one engine runs over"
                      " tensorParallelSize GPUs; leave it unset to use them all"]
    with pytest.raises(SpecError) as info:
        parse_spec(s)
    err = info.value
    assert (err.field, err.value) == ("engine.tensorParallelSize", tp)
    assert f"a divisor of the pod's {gpu_count(resources)} GPUs" in str(err)
    assert f"): {divisors}; one engine runs over tensorParallelSize GPUs" in str(err)


def test_other_gpu_resources_are_checked_by_the_operator_only(crd):
    """The CRD reads nvidia.com/gpu and amd.com/gpu; the operator any */gpu (an object
    the CRD admits still gets Ready=False, InvalidSpec)."""
    s = spec({"limits": {"gpu.example.com/gpu": 4}}, tensorParallelSize=3)
    assert admit(crd, obj(s))[1] == []
    with pytest.raises(SpecError, match=r"a divisor of the pod's 4 GPUs \(gpu.example.com/gpu\)"):
        parse_spec(s)


def test_mig_slices_cannot_be_spanned():
    s = spec({"limits": {"nvidia.com/mig-1g.10gb": 2}}, tensorParallelSize=2)
    with pytest.raises(SpecError) as info:
        parse_spec(s)
    assert (info.value.field, info.value.value) == ("engine.tensorParallelSize", 2)
    assert "1 on MIG slices (nvidia.com/mig-1g.10gb)" in str(info.value)


@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
def test_every_kv_cache_dtype_runs_tensor_parallel(crd, dtype):
    """Quantized caches included: each rank fits its scales to every rank's heads
    (an all-reduce MAX), so the engine takes them at any size."""
    for s in (spec({"limits": {"nvidia.com/gpu": 4}}, kvCacheDtype=dtype),
              spec({"limits": {"nvidia.com/gpu": 4}}, kvCacheDtype=dtype, tensorParallelSize=2)):
        assert admit(crd, obj(s))[1] == []
        parsed = parse_spec(s)
        args = engine_args(parsed)
        assert tp_arg(args) == str(parsed.engine.tensor_parallel_size) != "1"
        assert args[args.index("--kv-cache-dtype") + 1] == dtype
        EngineArgs(kv_cache_dtype=dtype, tensor_parallel_size=parsed.engine.tensor_parallel_size)


@pytest.mark.parametrize("value,crd_error", [
    (0, "below minimum 1"), (65, "above maximum 64"), (2.5, "must be integer"),
    (True, "must be integer"), ("2", "must be integer"),
])
def test_out_of_range_sizes_are_refused(crd, value, crd_error):
    s = spec(None, tensorParallelSize=value)
    _, errors = admit(crd, obj(s))
    assert any(crd_error in e for e in errors), errors
    with pytest.raises(SpecError, match=r"spec\.engine\.tensorParallelSize: got .*; an integer in \[1, 64\]"):
        parse_spec(s)


@pytest.mark.parametrize("quantity", ["1.5", "4x", "2Ki", -1, True])
def test_a_gpu_quantity_that_is_no_whole_number_is_refused(quantity):
    with pytest.raises(SpecError) as info:
        parse_spec(spec({"limits": {"nvidia.com/gpu": quantity}}))
    assert (info.value.field, info.value.value) == ("resources.limits.nvidia.com/gpu", quantity)
    assert "a whole number of GPUs" in str(info.value)


def test_the_crd_and_the_operator_agree_on_every_size_and_gpu_count(crd):
    """Every (GPU count, size, KV dtype) of a grid: the CRD admits exactly what the operator
    accepts, limits or requests, nvidia.com/gpu or amd.com/gpu."""
    grid = itertools.product(range(9), (None, 1, 2, 3, 4, 8), ("auto", "fp8"),
                             (("limits", "nvidia.com/gpu"), ("requests", "amd.com/gpu")))
    for gpus, tp, dtype, (where, name) in grid:
        engine = {"kvCacheDtype": dtype, **({"tensorParallelSize": tp} if tp else {})}
        s = spec({where: {name: gpus}}, **engine)
        admitted = admit(crd, obj(s))[1] == []
        try:
            parse_spec(s)
            accepted = True
        except SpecError:
            accepted = False
        assert admitted == accepted, (gpus, tp, dtype, where, name)


@pytest.mark.parametrize("extra", [["-tp", "2"], ["-tp=4"], ["--tensor-parallel-size", "2"],
                                   ["--tensor-parallel-size=1"]])
def test_the_crd_refuses_tensor_parallelism_in_extra_args(crd, extra):
    _, errors = admit(crd, obj(spec(None, extraArgs=extra)))
    assert len(errors) == 1, errors
    assert "must not repeat a flag the operator sets" in errors[0]
    assert "--tensor-parallel-size or -tp" in errors[0]
    assert "engine.tensorParallelSize the tensor parallelism" in errors[0]
    with pytest.raises(SpecError, match=r"engine\.tensorParallelSize"):
        parse_spec(spec(None, extraArgs=extra))


def test_neighbouring_flags_still_pass(crd):
    """The rule matches -tp and --tensor-parallel-size whole: the other parallelism flags
    (no-ops at 1) and flags that merely start with a t still pass both checks."""
    s = spec(None, extraArgs=["--pipeline-parallel-size", "1", "-pp=1", "--tokenizer", "/m/tok"])
    assert admit(crd, obj(s))[1] == []
    assert parse_spec(s).engine.extra_args[-2:] == ("--tokenizer", "/m/tok")


# ------------------------------------------------------------------ /dev/shm
@pytest.mark.parametrize("case,s,limit", [
    ("tp4-default-2gi", spec({"limits": {"nvidia.com/gpu": 4}}), DEFAULT_SHM_SIZE),
    ("tp4-shm-size", spec({"limits": {"nvidia.com/gpu": 4}}, shmSize="8Gi"), "8Gi"),
    ("tp2-of-four-gpus", spec({"limits": {"nvidia.com/gpu": 4}}, tensorParallelSize=2), "2Gi"),
    ("cpu-tp2", spec(None, tensorParallelSize=2), "2Gi"),
    ("cpu-tp2-shm-size", spec(None, tensorParallelSize=2, shmSize="512Mi"), "512Mi"),
    ("one-gpu-unbounded", spec({"limits": {"nvidia.com/gpu": 1}}), None),
    ("one-gpu-shm-size", spec({"limits": {"nvidia.com/gpu": 1}}, shmSize="1G"), "1G"),
    ("cpu-shm-size", spec(None, shmSize="1Gi"), "1Gi"),
])
def test_shared_memory_is_mounted_and_sized(crd, case, s, limit):
    assert admit(crd, obj(s))[1] == []
    volume, mount = dshm(pod_of(s))
    expected = {"medium": "Memory", **({"sizeLimit": limit} if limit else {})}
    assert volume == {"name": "dshm", "emptyDir": expected}
    assert mount == {"name": "dshm", "mountPath": "/dev/shm"}


def test_a_single_process_cpu_pod_has_no_shared_memory_volume():
    assert dshm(pod_of(spec(None))) == (None, None)
    assert dshm(pod_of(spec(None, tensorParallelSize=1))) == (None, None)


@pytest.mark.parametrize("value", ["0", "2GB", "1.5Gi", "-1Gi", "lots", ""])
def test_a_bad_shm_size_is_refused(crd, value):
    s = spec(None, shmSize=value)
    _, errors = admit(crd, obj(s))
    assert any("shmSize" in e for e in errors), errors
    with pytest.raises(SpecError) as info:
        parse_spec(s)
    assert info.value.field == "engine.shmSize"


@pytest.mark.parametrize("s", [
    spec({"requests": {"cpu": "16", "memory": "128Gi"},
          "limits": {"memory": "192Gi", "nvidia.com/gpu": 4}}),
    spec({"limits": {"cpu": "4", "memory": "8Gi"}}, tensorParallelSize=2, shmSize="1Gi"),
])
def test_tensor_parallel_deployments_are_valid_kubernetes_objects(s):
    children = build_children(Owner("chat", "llm", "uid"), parse_spec(s), 2, "img", False)
    for o in children.all():
        kubernetes_validate.validate(o, "1.36.0", strict=True)
