import pytest

from trainscale.runtime.connector import resolve


def test_cpu_defaults():
    c = resolve()
    assert (c.accelerator, c.devices, c.strategy, c.precision, c.world_size) == ("cpu", 1, "single", "32-true", 1)


def test_auto_strategy_picks_ddp_for_several_processes():
    assert resolve(devices=2).strategy == "ddp"
    assert resolve(devices=1, num_nodes=2).strategy == "ddp"
    assert resolve(devices=2, num_nodes=3).world_size == 6


def test_cuda_auto_takes_every_gpu():
    c = resolve(cuda_count=4)
    assert (c.accelerator, c.devices, c.strategy) == ("cuda", 4, "ddp")
    assert resolve("gpu", 2, cuda_count=4).accelerator == "cuda"


@pytest.mark.parametrize("devices", [0, -1, -8])
def test_nonpositive_devices(devices):
    with pytest.raises(ValueError, match=r"devices=.* must be >= 1"):
        resolve(devices=devices)


def test_devices_wrong_type():
    with pytest.raises(ValueError, match="positive int or 'auto'"):
        resolve(devices="two")


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown strategy='dpp'.*'auto'.*'single'.*'ddp'"):
        resolve(strategy="dpp")


def test_more_cuda_devices_than_exist():
    with pytest.raises(ValueError, match=r"devices=4 asks for more CUDA devices than the 2 visible"):
        resolve("cuda", 4, "ddp", cuda_count=2)


def test_cuda_without_cuda():
    with pytest.raises(ValueError, match="no CUDA device is visible; pass accelerator='cpu'"):
        resolve("cuda", 2, "ddp", cuda_count=0)


def test_single_with_several_devices():
    with pytest.raises(ValueError, match="pass strategy='ddp'"):
        resolve(devices=2, strategy="single")


def test_unknown_accelerator_and_precision():
    with pytest.raises(ValueError, match="choose one of 'auto', 'cpu'"):
        resolve(accelerator="tpu")
    with pytest.raises(ValueError, match="unknown precision='fp16'.*'16-mixed'"):
        resolve(precision="fp16")


def test_num_nodes():
    with pytest.raises(ValueError, match="num_nodes=0"):
        resolve(num_nodes=0)


def test_mps_rules():
    assert resolve(has_mps=True).accelerator == "mps"
    with pytest.raises(ValueError, match="MPS offers one device"):
        resolve("mps", 2, has_mps=True)


def test_the_strategy_flag_type_holds_exactly_the_names_the_resolver_takes():
    """``StrategyFlag`` (what type checkers and the command line accept) against the registry of strategy classes
    and the start-method names: a strategy registered without its name in the type would be refused by mypy."""
    from typing import get_args

    from trainscale.runtime.connector import START_METHOD_NAMES
    from trainscale.runtime.flags import StrategyFlag
    from trainscale.runtime.strategies import STRATEGIES
    from trainscale.runtime.strategies.ddp import FIND_UNUSED_NAMES

    # the names _resolve_strategy takes
    assert get_args(StrategyFlag) == (*STRATEGIES, *START_METHOD_NAMES, *FIND_UNUSED_NAMES)


@pytest.mark.parametrize(("given", "unified", "warns"), [(16, "16-mixed", True), ("16", "16-mixed", True),
                                                         ("bf16", "bf16-mixed", True), (32, "32-true", False),
                                                         ("32", "32-true", False), (64, "64-true", False),
                                                         ("64", "64-true", False), ("64-true", "64-true", False)])
def test_lightnings_older_precision_spellings_are_converted_with_its_warning(recwarn, given, unified, warns):
    assert resolve(precision=given).precision == unified
    said = [str(w.message) for w in recwarn if "historical reasons" in str(w.message)]
    assert said == ([f"`precision={given!r}` is supported for historical reasons but its usage is discouraged. "
                     f"Please set your precision to {unified} instead!"] if warns else [])


def test_an_unknown_precision_is_refused_naming_the_choices():
    for given in (True, 8, "fp64", "64-mixed"):
        with pytest.raises(ValueError, match=rf"unknown precision={given!r}; choose one of .*'64-true'"):
            resolve(precision=given)


def test_double_precision_on_mps_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="MPS does not have; pass accelerator='cpu'"):
        resolve(accelerator="mps", has_mps=True, precision="64-true")
    assert resolve(accelerator="mps", has_mps=True, precision="32-true").accelerator == "mps"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp", "ddp_spawn", "tp", "pp"])
def test_double_precision_is_taken_by_every_strategy(strategy):
    parallel = {"dp_replicate": 2, "dp_shard": 2} if strategy == "hsdp" else None
    assert resolve(accelerator="cpu", devices=4, strategy=strategy, parallel=parallel, precision=64).precision == "64-true"
