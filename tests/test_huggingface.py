"""Hugging Face ``transformers`` models: trained by ``Trainer.fit`` on dict batches (the loss from the model's
output), under ddp equal to one plain PyTorch process, under fsdp sharded per decoder layer by default
(``_no_split_modules``), under tp split by the model's own plan; their checkpoints exported (``trainscale
export``) to a directory that ``from_pretrained`` loads with the trained weights, from a ddp checkpoint file and
fsdp and tp DCP directories, tied weights (Llama, GPT-2, T5) written once as ``save_pretrained`` writes them.

One 2-rank launch (ddp, fsdp, then tp on one process group) serves the distributed tests; run under the shared lock
(``flock /tmp/trainscale-heavy.lock pytest ...``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install 'trainscale[hf]'")

from tests import hf_workers  # noqa: E402
from tests.helpers import run_distributed, run_python  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return run_distributed(hf_workers.hf_body, str(root), timeout=120)


def _assert_states_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)


def _checkpoint(run_dir: str) -> Path:
    last = Path(run_dir) / "checkpoints" / "last"
    return last.parent / last.read_text().strip()


def test_ddp_trains_a_transformers_model_as_one_process(runs):
    """2 ranks × batch 4 = one plain process with batch 8 (``model(**batch).loss``, SGD), tied embeddings;
    samples and tokens counted from the dict batches; validation loss from the model's own loss."""
    ddp = runs[0]["ddp"]
    _assert_states_close(ddp["state"], hf_workers.plain_reference(tie=True))
    _assert_states_close(runs[1]["ddp"]["state"], ddp["state"])
    tele = ddp["summary"]["telemetry"]
    assert tele["tokens_per_s"] == pytest.approx(tele["samples_per_s"] * hf_workers.SEQ)
    assert ddp["summary"]["steps"] == 2 and ddp["summary"]["val_loss"] > 0


def test_fsdp_shards_each_decoder_layer_by_default(runs):
    """No auto_wrap_policy: the units are LlamaForCausalLM's ``_no_split_modules`` (each LlamaDecoderLayer), then
    the root; the decoder layers checkpointed by class name; the weights those of one plain process."""
    fsdp = runs[0]["fsdp"]
    assert fsdp["units"] == ["FSDPLlamaForCausalLM", "FSDPLlamaDecoderLayer", "FSDPLlamaDecoderLayer"]
    _assert_states_close(fsdp["state"], hf_workers.plain_reference(tie=False))


def test_the_fsdp_fitted_model_is_called_and_generates(runs):
    """The user's own model is FSDP's root: called in ``on_fit_start`` (sharded, before the first step) it gives the
    initial model's logits; after ``fit``, still sharded, ``model(input_ids=...)`` and greedy ``generate()`` give
    on both ranks what the trained weights give in one plain process."""
    initial, trained = hf_workers.tiny_llama(0), hf_workers.tiny_llama(0)
    trained.load_state_dict(runs[0]["fsdp"]["state"])
    with torch.no_grad():
        start = initial(input_ids=hf_workers.PROMPT).logits
    logits, tokens = hf_workers.greedy(trained)
    assert tokens.shape == (2, hf_workers.PROMPT.shape[1] + 4)
    for rank in runs:
        torch.testing.assert_close(rank["fsdp"]["at_start"], start, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank["fsdp"]["logits"], logits, rtol=1e-5, atol=1e-6)
        assert torch.equal(rank["fsdp"]["tokens"], tokens)


def test_tp_splits_by_the_models_own_plan(runs):
    """No tp_plan: LlamaForCausalLM's own (base_model_tp_plan and the head's), translated to torch styles: q/k/v
    and the MLP's first layers by columns, o_proj/down_proj by rows, the embedding by vocabulary rows, the head by
    columns with whole logits out, norms plain; the head tied to the embedding stays one parameter; the weights
    those of one process with the same batch of 4."""
    tp = runs[0]["tp"]
    placements = tp["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == "S(0)"
    assert placements["model.layers.1.mlp.down_proj.weight"] == "S(1)"
    assert placements["model.embed_tokens.weight"] == placements["lm_head.weight"] == "S(0)"
    assert placements["model.norm.weight"] == "plain"
    assert all(rank["tp"]["tied"] for rank in runs)
    assert tp["summary"]["steps"] == 4  # both ranks read the same batches: data parallel size 1
    for key, want in hf_workers.plain_reference(batch_size=4, tie=True).items():
        torch.testing.assert_close(tp["state"][key], want, rtol=1e-5, atol=1e-5, msg=key)


def test_tp_plan_styles_without_a_translation_are_named():
    from trainscale.lightning.module import LoopModule
    from trainscale.runtime.strategies.apply_tp import hf_plan

    loop = LoopModule(hf_workers.tiny_llama(), None)
    assert hf_plan(loop, 2)["model.model.layers.*.self_attn.o_proj"].__class__.__name__ == "RowwiseParallel"
    loop.model._tp_plan = {"model.layers.*.mlp.gate_proj": "local_colwise", "lm_head": "colwise"}
    with pytest.raises(ValueError, match="style\\(s\\) 'local_colwise', which trainscale does not translate"):
        hf_plan(loop, 2)
    with pytest.raises(ValueError, match="tp=3 must divide LlamaForCausalLM's num_attention_heads=4"):
        hf_plan(LoopModule(hf_workers.tiny_llama(), None), 3)
    tied = hf_plan(LoopModule(hf_workers.tiny_llama(tie=True), None), 2)  # tied embeddings: split alike, kept tied
    assert {"model.model.embed_tokens", "model.lm_head"} <= tied.keys()


def _loaded_logits(directory: Path, state: dict, tie: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(logits of ``from_pretrained(directory)``, logits of the tiny Llama given ``state``, the loaded weights)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(directory)
    trained = hf_workers.tiny_llama(1, tie)
    trained.load_state_dict(state)
    ids = hf_workers.TokenDicts(2, seed=5).ids
    with torch.no_grad():
        return loaded(input_ids=ids).logits, trained(input_ids=ids).logits, loaded.state_dict()


def _tensors(directory: Path) -> dict:
    """Every tensor in the safetensors files of ``directory``."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_export_of_a_ddp_checkpoint_loads_with_from_pretrained(runs, tmp_path):
    """The checkpoint file (tied embeddings kept once) → config.json naming the class and dtype, generation_config.json,
    safetensors split at max_shard_size with save_pretrained's index → from_pretrained gives the same weights and
    logits."""
    from trainscale.export import export

    out = export(Path(runs[0]["ddp"]["dir"]) / "checkpoints" / "last", tmp_path / "model", max_shard_size=20_000)
    loaded, trained, state = _loaded_logits(out, runs[0]["ddp"]["state"], tie=True)
    assert torch.equal(loaded, trained)
    assert all(torch.equal(state[k], v) for k, v in runs[0]["ddp"]["state"].items())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["_from_model_config"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files, tensors = sorted(out.glob("model-*-of-*.safetensors")), _tensors(out)
    assert len(files) > 1 and set(index["weight_map"].values()) == {f.name for f in files}
    assert index["weight_map"].keys() == tensors.keys() and "lm_head.weight" not in tensors  # tied: written once
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    with pytest.raises(ValueError, match="not an empty directory"):
        export(_checkpoint(runs[0]["ddp"]["dir"]), out)


def test_an_fsdp_export_of_a_tied_model_equals_save_pretrained(runs, tmp_path):
    """GPT-2 (head tied to the token embedding) trained under fsdp: its sharded checkpoint holds the tied weight under
    both names; the export writes what ``save_pretrained`` of the same weights writes, tensor for tensor."""
    out = _export_equals_save_pretrained(runs[0]["gpt2"], tmp_path)
    assert (out / "generation_config.json").is_file()


def _export_equals_save_pretrained(run: dict, tmp_path: Path, build=hf_workers.tiny_gpt2) -> Path:
    """Export the run ``run``'s last checkpoint and check it holds the tensors ``save_pretrained`` of its trained
    weights in a ``build()`` model writes (each tied weight once) and names the class; the export's directory."""
    from trainscale.export import export

    out = export(_checkpoint(run["dir"]), tmp_path / "export")
    reference = build()
    reference.load_state_dict(run["state"])
    reference.save_pretrained(tmp_path / "reference")
    got, want = _tensors(out), _tensors(tmp_path / "reference")
    assert got.keys() == want.keys() and "lm_head.weight" not in got
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(reference).__name__]
    return out


def test_an_fsdp_export_of_t5_writes_its_shared_embedding_once(runs, tmp_path):
    """T5 ties one weight under four names (shared, the encoder's and decoder's token embeddings, the head): its
    fsdp checkpoint holds all four, the export what ``save_pretrained`` of the same weights writes."""
    assert {"shared.weight", "encoder.embed_tokens.weight", "lm_head.weight"} <= runs[0]["t5"]["state"].keys()
    out = _export_equals_save_pretrained(runs[0]["t5"], tmp_path, hf_workers.tiny_t5)
    assert "shared.weight" in _tensors(out) and "encoder.embed_tokens.weight" not in _tensors(out)


def test_a_tp_export_of_a_tied_model_equals_save_pretrained(runs, tmp_path):
    """GPT-2 under tp by a user's plan that splits the vocabulary rows of the token embedding and of the head tied to
    it: the tie stays one parameter through ``parallelize_module``, one step gives the weights of one plain process
    with the same batch of 4, and the export of its DCP directory writes what ``save_pretrained`` of the same weights
    writes, tensor for tensor (the tied head once). A plan that splits only the head is refused, naming both."""
    tp = runs[0]["gpt2_tp"]
    assert all(rank["gpt2_tp"]["tied"] for rank in runs) and tp["placement"] == "(Shard(dim=0),)"
    _assert_states_close(tp["state"], hf_workers.plain_reference(batch_size=4, model=hf_workers.tiny_gpt2(), steps=1))
    _export_equals_save_pretrained(tp, tmp_path)
    assert "tied weights transformer.wte.weight, lm_head.weight" in tp["half_plan"]
    assert "RowwiseParallel(input_layouts=Replicate()) on the token embedding" in tp["half_plan"]


def test_a_from_pretrained_directory_loads_into_a_sharded_model(runs):
    """``load_pretrained`` into a model built on the meta device and sharded by fsdp: the exported ddp weights, each
    rank reading its own slices, the tied head restored with the embedding."""
    imported = runs[0]["imported"]
    assert imported["sharded"]
    for rank in runs:
        assert all(torch.equal(rank["imported"]["state"][k], v) for k, v in runs[0]["ddp"]["state"].items())


def test_export_of_a_tp_checkpoint(runs, tmp_path):
    """The tensor-parallel DCP directory (vocabulary rows and heads split over 2 ranks) exports whole, the head tied
    to the embedding written once."""
    from trainscale.export import export

    out = export(_checkpoint(runs[0]["tp"]["dir"]), tmp_path / "model")
    loaded, trained, state = _loaded_logits(out, runs[0]["tp"]["state"], tie=True)
    assert torch.equal(loaded, trained) and "lm_head.weight" not in _tensors(out)
    assert all(torch.equal(state[k], v) for k, v in runs[0]["tp"]["state"].items())


def _tokenizer_dir(directory: Path) -> Path:
    """A word-level tokenizer of the tiny vocabulary, saved as ``save_pretrained`` saves one (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(hf_workers.VOCAB - 1)} | {"[UNK]": hf_workers.VOCAB - 1}
    backend = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(directory)
    return directory


def test_cli_exports_an_fsdp_checkpoint_with_its_tokenizer(runs, tmp_path):
    """``trainscale export DIR --format safetensors --tokenizer TOK OUT`` in a subprocess, from the sharded DCP
    directory: the weights, and the tokenizer that ``AutoTokenizer.from_pretrained(OUT)`` loads."""
    from transformers import AutoTokenizer

    ckpt = _checkpoint(runs[0]["fsdp"]["dir"])
    tokenizer = _tokenizer_dir(tmp_path / "tokenizer")
    done, _ = run_python(["-m", "trainscale.cli", "export", str(ckpt), "--format", "safetensors", "--tokenizer",
                          str(tokenizer), "out"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "LlamaForCausalLM.from_pretrained" in done.stdout
    loaded, trained, state = _loaded_logits(tmp_path / "out", runs[0]["fsdp"]["state"], tie=False)
    assert torch.equal(loaded, trained)
    assert all(torch.equal(state[k], v) for k, v in runs[0]["fsdp"]["state"].items())
    assert AutoTokenizer.from_pretrained(tmp_path / "out")("w3 w7 w120")["input_ids"] == [3, 7, 120]


def test_cli_refuses_a_config_of_another_architecture(runs, tmp_path, monkeypatch, capsys):
    """``trainscale export --config`` with a GPT-2 config for Llama weights: exit 2, an error naming the disagreement
    and the fix, nothing written (the command's ``main`` in this process: the run above is the command whole)."""
    from trainscale.cli import main

    hf_workers.tiny_gpt2().config.save_pretrained(tmp_path / "gpt2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the current directory on it
    code = main(["export", str(_checkpoint(runs[0]["ddp"]["dir"])), "--config", str(tmp_path / "gpt2"), "out"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "disagree" in err and "GPT2LMHeadModel" in err and "--config" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_export_without_a_config_names_the_fix(tmp_path):
    """A checkpoint without the model's config (a model that was no transformers model when saved): the error asks
    for it; given as a directory holding config.json, the export loads."""
    from trainscale.export import export
    from trainscale.runtime import checkpoint_io

    model = hf_workers.tiny_llama(2)
    checkpoint_io.save_file({"model": model.state_dict()}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="pass config="):
        export(tmp_path / "plain.pt", tmp_path / "out")
    # a config path that holds none (was a bare "[Errno 2]"), and shard sizes save_pretrained would read as none
    with pytest.raises(ValueError, match="'nowhere' is neither a config.json nor a directory holding one"):
        export(tmp_path / "plain.pt", tmp_path / "out", config="nowhere")
    for size in (0, "bogus"):
        with pytest.raises(ValueError, match=r"--max-shard-size\) must be a positive size"):
            export(tmp_path / "plain.pt", tmp_path / "out", config=tmp_path, max_shard_size=size)
    assert not (tmp_path / "out").exists()
    model.config.save_pretrained(tmp_path / "config")  # the fix: the config given as a directory holding config.json
    _, _, state = _loaded_logits(export(tmp_path / "plain.pt", tmp_path / "out", config=tmp_path / "config"),
                                 model.state_dict(), tie=False)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_dict_batches_need_the_models_own_loss():
    """A dict batch goes to the model as keywords: a given loss_fn, or an output without a loss, is refused."""
    from trainscale.lightning.module import LoopModule

    batch = next(iter(torch.utils.data.DataLoader(hf_workers.TokenDicts(2), batch_size=2)))
    model = hf_workers.tiny_llama()
    with pytest.raises(ValueError, match="drop loss_fn"):
        LoopModule(model, torch.nn.functional.cross_entropy)(batch)
    with pytest.raises(TypeError, match="put 'labels' in the batch"):
        LoopModule(model, None)({k: v for k, v in batch.items() if k != "labels"})
    assert LoopModule(model, None)(batch).ndim == 0
    assert "transformers" in sys.modules  # (imported by the tiny model, as a user's script does)


def test_fsdp_units_from_no_split_modules_or_names():
    """Units without a policy: the model's ``_no_split_modules``; a policy may name classes as strings; a name
    absent from the model, or a lone string, is refused with the fix."""
    from trainscale.lightning.module import LoopModule
    from trainscale.runtime.strategies.apply_fsdp import fsdp_units
    from trainscale.runtime.strategies.fsdp import _wrap_policy

    loop = LoopModule(hf_workers.tiny_llama(), None)
    layers = list(loop.model.model.layers)
    assert fsdp_units(loop, (), "fsdp") == layers
    assert fsdp_units(loop, _wrap_policy({"LlamaDecoderLayer", torch.nn.Embedding}), "fsdp") == \
        [loop.model.model.embed_tokens, *layers]
    with pytest.raises(ValueError, match="GPT2Block do not occur in the model; its module classes are: .*LlamaMLP"):
        fsdp_units(loop, ("GPT2Block",), "fsdp")
    with pytest.raises(ValueError, match="must be a set of nn.Module classes or class names"):
        _wrap_policy("LlamaDecoderLayer")


def test_load_pretrained_of_a_directory_without_safetensors_names_what_it_needs(tmp_path):
    from trainscale.export import load_pretrained

    model = hf_workers.tiny_llama(2)
    model.config.save_pretrained(tmp_path / "config_only")  # config.json and no weights
    with pytest.raises(ValueError, match=r"config_only' holds no \.safetensors file: pass the directory"):
        load_pretrained(model, tmp_path / "config_only")
    with pytest.raises(ValueError, match="is not a directory"):
        load_pretrained(model, tmp_path / "missing")
