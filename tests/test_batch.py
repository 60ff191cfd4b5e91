"""Batches of any container reach the device: to_device, the prefetcher's record_stream, the bf16-true cast
and batch_size walk mappings (UserDict, BatchEncoding-like), dataclasses, named tuples and objects with .to.
Run on device="meta" (no GPU needed)."""

import contextlib
import dataclasses
from collections import OrderedDict, UserDict, defaultdict, namedtuple

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from trainscale.runtime import prefetch
from trainscale.runtime.batch import apply_to_tensors, batch_counts, batch_size, tensors, to_device
from trainscale.runtime.precision import Precision

META = torch.device("meta")


class Encoding(UserDict):
    """Like Hugging Face's BatchEncoding: a UserDict with its own .to and extra attributes."""

    def __init__(self, data, encodings=None):
        super().__init__(data)
        self.encodings = encodings

    def to(self, device):
        self.data = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.data.items()}
        return self


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "keep"
    derived: torch.Tensor = dataclasses.field(init=False, default=None)

    def __post_init__(self):
        object.__setattr__(self, "derived", self.x * 2)


class GraphBatch:
    """An object with .to and its tensors in attributes (like torch_geometric's Data)."""

    def __init__(self, nodes, edges):
        self.nodes, self.edges = nodes, edges

    def to(self, device):
        return GraphBatch(self.nodes.to(device), self.edges.to(device))


Pair = namedtuple("Pair", "inputs targets")


def test_every_container_reaches_the_device():
    x, y = torch.randn(4, 3), torch.arange(4)
    batch = {
        "user_dict": UserDict({"x": x}),
        "encoding": Encoding({"input_ids": y}, encodings=["fast"]),
        "dataclass": Frozen(x, y),
        "namedtuple": Pair(x, y),
        "object": GraphBatch(x, y),
        "ordered": OrderedDict(a=x),
        "default": defaultdict(list, a=x),
        "nested": [(x, {"deep": [y]})],
        "text": "untouched", "count": 3, "none": None,
    }
    moved = to_device(batch, META)
    assert all(t.device == META for t in tensors(moved))
    assert len(list(tensors(moved))) == len(list(tensors(batch))) == 13
    assert type(moved["user_dict"]) is UserDict and type(moved["encoding"]) is Encoding
    assert moved["encoding"].encodings == ["fast"]  # moved by its own .to: attributes kept
    assert type(moved["dataclass"]) is Frozen and moved["dataclass"].note == "keep"
    assert moved["dataclass"].derived.device == META  # an init=False field too
    assert type(moved["namedtuple"]) is Pair and type(moved["object"]) is GraphBatch
    assert type(moved["ordered"]) is OrderedDict and moved["default"].default_factory is list
    assert (moved["text"], moved["count"], moved["none"]) == ("untouched", 3, None)
    del batch["encoding"]  # BatchEncoding.to moves in place; no container of ours does
    assert all(t.device.type == "cpu" for t in tensors(batch))


def test_objects_with_to_decide_what_stays_on_the_host():
    packed = pack_padded_sequence(torch.randn(2, 5, 3), torch.tensor([5, 3]), batch_first=True)
    moved = to_device(packed, META)
    assert moved.data.device == META
    assert moved.batch_sizes.device.type == "cpu"  # PackedSequence.to keeps it on the host, as it must


def test_a_tensor_already_on_the_device_is_kept():
    x = torch.randn(2, device=META)
    assert to_device(Pair(x, x), META).inputs is x


def test_bf16_true_casts_floating_tensors_in_any_container():
    batch = Frozen(torch.randn(2, 3), torch.arange(2))
    cast = Precision("bf16-true", "cpu").convert_input(UserDict(b=batch))
    assert cast["b"].x.dtype == torch.bfloat16 and cast["b"].y.dtype == torch.int64


def test_batch_size_and_tokens_of_any_container():
    ids = torch.zeros(6, 10, dtype=torch.long)
    assert batch_counts(Encoding({"input_ids": ids})) == (6, 60)
    assert batch_size(Frozen(torch.randn(5, 2), torch.arange(5))) == 5
    assert batch_size(GraphBatch(torch.randn(7, 2), torch.zeros(2, 9))) == 7
    assert batch_size({"name": "x", "loss_weight": torch.tensor(1.0), "x": torch.randn(3, 2)}) == 3
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        batch_size({"text": ["a", "b"]})


def test_apply_to_tensors_leaves_objects_with_to_alone_unless_asked():
    obj = GraphBatch(torch.randn(2), torch.randn(2))
    assert apply_to_tensors([obj], lambda t: t * 0)[0] is obj
    assert apply_to_tensors([obj], lambda t: t, movable=lambda o: "moved") == ["moved"]


class _FakeStream:
    def wait_stream(self, other):
        pass


def test_prefetcher_records_the_loop_stream_on_every_moved_tensor(monkeypatch):
    """The CUDA prefetcher's bookkeeping on CPU: streams faked, the copies go to the meta device."""
    recorded = []
    loop_stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: loop_stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((t, s)), raising=False)
    packed = pack_padded_sequence(torch.randn(2, 5, 3), torch.tensor([5, 3]), batch_first=True)
    batches = [Frozen(torch.randn(2, 3), torch.arange(2)), {"g": GraphBatch(torch.randn(3), torch.randn(4))}, packed]
    got = list(prefetch.prefetch_to_cuda(batches, lambda b: to_device(b, META), META))
    assert [type(b) for b in got] == [Frozen, dict, type(packed)]
    on_device = [t for b in got for t in tensors(b) if t.device == META]
    assert len(on_device) == 3 + 2 + 1  # Frozen: x, y, derived; GraphBatch: 2; PackedSequence: data
    assert [id(t) for t, _ in recorded] == [id(t) for t in on_device]  # the host-side batch_sizes is skipped
    assert all(s is loop_stream for _, s in recorded)
