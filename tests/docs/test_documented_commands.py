"""Every command line the project shows users, checked with the real programs.

Commands come from the fenced ``bash``/``sh``/``console`` blocks of README.md, docs/ and
bench/README.md (every fenced block must say its language and no code block may be an indented
one, so that none hides from this test), from their inline code spans that start (past
``VAR=value`` assignments) with a program this test has a rule for, and from the opening
comment lines of configs/, launch/ and slurm/. Each is checked by what it runs:

- ``iga-ds ...``: parsed by the real command-line parser; ``iga-ds train`` and
  ``launch/train.py`` resolve their config, overrides, paths and DeepSpeed JSON with
  ``--dry-run``; ``iga-ds experiment`` lists its grid's cells with ``--dry-run``;
- ``deepspeed``, ``torchrun``, ``srun``, ``launch/*.sh``, ``sbatch slurm/*.sbatch``,
  ``docker run``: the launcher's own options where it can parse them (DeepSpeed's runner,
  torchrun's), then the command they start, as above; a template's overrides go through a dry
  run of the config it would train;
- ``python bench/*.py`` (or a bench/ script under ``deepspeed``/``torchrun``): the script's own
  argument parser, stopped right after parsing;
- ``make``: the target exists; ``docker build``: the build arguments exist in the Dockerfile.

Placeholders (``N``, ``OUT``, ``CFG.yaml``, ``[optional ...]``) are parsed but not run. Programs
that are not this project's (``vllm``, ``lm_eval``, ``salloc``, ...) are listed in EXTERNAL with
what they are; any other program fails the test until a rule covers it. results/ (archived runs)
is not checked.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
HEADERS = [*sorted((REPO / "configs").rglob("*.yaml")), *sorted((REPO / "launch").iterdir()),
           *sorted((REPO / "slurm").glob("*.sbatch"))]
EXTERNAL = {
    "vllm": "the teacher's inference server",
    "lm_eval": "lm-evaluation-harness",
    "salloc": "Slurm's interactive allocation",
    "apptainer": "the container runtime of slurm/apptainer.sbatch",
    "mkdir": "coreutils",
    "tensorboard": "TensorBoard's viewer",
    "cat": "coreutils",
    "tar": "the archiver",
    "touch": "coreutils",
    "pip": "the package installer",
    ".": "the shell's source builtin (activates .venv, which make creates)",
}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass
class Command:
    where: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


# -- finding the commands ----------------------------------------------------------------------


def _fenced(text: str) -> list[tuple[str, int, str]]:
    return [(m.group(1), text[:m.start()].count("\n") + 1, m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)]


_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s")


def _indented(text: str) -> list[tuple[int, str]]:
    """Indented code blocks outside fences, as (first line, body): lines indented by four spaces
    after a blank line, unless they go on a list item (Markdown reads those as the item's text)."""
    blocks: list[tuple[int, list[str]]] = []
    in_fence = in_list = in_block = False
    previous_blank = True
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_fence, in_block = not in_fence, False
        elif not in_fence and line.strip():
            if line.startswith("    ") and (in_block or (previous_blank and not in_list)):
                if not in_block:
                    blocks.append((number, []))
                blocks[-1][1].append(line[4:])
                in_block = True
            else:
                in_block = False
                if _LIST_ITEM.match(line):
                    in_list = True
                elif not line[0].isspace():
                    in_list = False
        elif in_block and not line.strip():
            blocks[-1][1].append("")
        previous_blank = not line.strip()
    return [(start, "\n".join(body).strip("\n") + "\n") for start, body in blocks]


def _split_commands(line: str) -> list[str]:
    line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
    return [part.strip() for part in re.split(r"\s&&\s|\s;\s", line) if part.strip()]


def doc_commands() -> list[Command]:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO)
        # an indented block fails test_no_indented_code_blocks; its commands are checked meanwhile
        for lang, line, body in [*_fenced(text), *(("bash", start - 1, body) for start, body in _indented(text))]:
            if lang not in ("bash", "sh", "shell", "console"):
                continue
            body = re.sub(r"\\\n\s*", " ", body)
            for offset, raw in enumerate(body.splitlines(), 1):
                raw = raw.strip()
                if lang == "console":
                    if not raw.startswith("$ "):
                        continue  # output
                    raw = raw[2:]
                if raw and not raw.startswith("#"):
                    found += [Command(f"{rel}:{line + offset}", c) for c in _split_commands(raw)]
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose):
            if _inline_command(span):
                found.append(Command(f"{rel} (inline)", span))
    return found


def _inline_command(span: str) -> bool:
    """An inline span is a command when it starts, past ``VAR=value`` assignments, with a
    program this test has a rule for and gives it arguments; not when it only names a command
    (`iga-ds eval`, `make`), names a launcher's options (`deepspeed --launcher slurm`,
    `sbatch --ntasks=2`), elides (`--grid ...`), or quotes a message the program prints
    (`iga-ds selfcheck: FAILED ...`)."""
    try:
        words = shlex.split(span)
    except ValueError:
        return False
    program, args = _program(words)
    if not _has_rule(program) or not args or any("..." in w for w in args) or args[0].endswith(":"):
        return False
    if program in ("iga-ds", "python", "python3"):  # `iga-ds data merge` names a subcommand
        names_only = all(not w.startswith("-") and "/" not in w and "." not in w and not PLACEHOLDER.match(w)
                         for w in args)
        return not (names_only and len(args) <= 2)
    return _has_operand(args)


def _has_operand(args: list[str]) -> bool:
    """Whether the arguments give more than options: a word that is neither an option nor the
    value of the option before it (``--nodes 2``; ``--`` takes none)."""
    for i, word in enumerate(args):
        if word.startswith("-"):
            continue
        option_before = args[i - 1] if i else ""
        if option_before.startswith("-") and option_before != "--" and "=" not in option_before:
            continue
        return True
    return False


def header_commands() -> list[Command]:
    """Commands in the opening comment block of configs, launch scripts and Slurm templates
    (a line ending in a backslash goes on on the next comment line)."""
    found = []
    for path in HEADERS:
        lines = path.read_text(encoding="utf-8").splitlines()
        body, start = "", 0
        for number, line in enumerate(lines, 1):
            if number == 1 and line.startswith("#!"):
                continue
            if not line.startswith("#"):
                break
            text = line.lstrip("#").strip()
            body, start = (body + " " + text, start) if body else (text, number)
            if body.endswith("\\"):
                body = body[:-1].strip()
                continue
            found += [Command(f"{path.relative_to(REPO)}:{start}", c) for c in _split_commands(body) if _is_command(c)]
            body = ""
    return found


GPU_RUNS = REPO / "bench" / "gpu_runs.sh"
# what gpu_runs.sh's variables hold where a command uses them (N GPUs: 1; OUT_DIR: a placeholder)
GPU_RUNS_VALUES = {"n": "1", "out": "OUT", "methods": "erm,iga_fused", "steps": "10"}


def gpu_runs_stages() -> dict[str, str]:
    """bench/gpu_runs.sh's ``case`` stages: label (``step*`` for stepN) -> body, each command on
    one line."""
    text = GPU_RUNS.read_text(encoding="utf-8").replace("\\\n", " ")
    return dict(re.findall(r"^    ([a-z0-9]+\*?)\)\n(.*?)^      ;;", text, flags=re.M | re.S))


def gpu_runs_commands() -> list[Command]:
    """The benchmark commands bench/gpu_runs.sh runs (it needs GPUs), with its defaults: a
    ``${VAR:-default}`` as its default, a required ``${VAR:?...}`` as the placeholder VAR."""

    def value(m: re.Match) -> str:
        name, kind, default = m.group(1), m.group(2), m.group(3)
        if kind == ":-":
            return default
        return name if kind == ":?" else GPU_RUNS_VALUES[name]

    found = []
    for stage, body in gpu_runs_stages().items():
        for line in re.findall(r"\bpython3 (bench/.*)$", body, flags=re.M):
            words = shlex.split(re.sub(r"\$\{?(\w+)(?:(:[-?])([^}]*))?\}?", value, line))
            found.append(Command(f"bench/gpu_runs.sh ({stage})", "python " + shlex.join(words)))
    return found


def _program(words: list[str]) -> tuple[str, list[str]]:
    """The program and its arguments, past environment assignments."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    return (words[i], words[i + 1:]) if i < len(words) else ("", [])


def _has_rule(program: str) -> bool:
    return program in RULES or (program.startswith(("launch/", "slurm/", "bench/")) and (REPO / program).is_file())


def _is_command(text: str) -> bool:
    try:
        words = shlex.split(text)
    except ValueError:
        return False
    program, _ = _program(words)
    return _has_rule(program) or program in EXTERNAL


def _env(words: list[str]) -> dict[str, str]:
    env = {}
    for word in words:
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", word)
        if not m:
            break
        env[m.group(1)] = m.group(2)
    return env


def _concrete(args: list[str]) -> tuple[list[str], bool]:
    """Arguments with optional groups unwrapped (``[--out F]`` -> ``--out F``) and elided ones
    dropped (``[KEY=VALUE ...]``, ``FILE...``); True when a placeholder remains (an all-caps
    name such as N or OUT, or one with an extension such as CFG.yaml)."""
    out, group, placeholder = [], None, False
    for word in args:
        if group is None and word.startswith("["):
            group, word = [], word[1:]
        if group is not None:
            closing = word.endswith("]")
            group.append(word[:-1] if closing else word)
            if closing:
                if not any("..." in w for w in group):  # an elided optional group is left out
                    out += [w for w in group if w]
                group = None
            continue
        if "..." in word:
            placeholder = True
            continue
        out.append(word)
    placeholder = placeholder or any(PLACEHOLDER.match(w) or (PLACEHOLDER.match(w.split(".")[0]) and "." in w)
                                     for w in out)
    return out, placeholder


def _sample(args: list[str]) -> list[str]:
    """Placeholders replaced by a value every option takes (a parser checks them, not a run)."""
    return ["1" if PLACEHOLDER.match(w) else w for w in args]


# -- checking them -----------------------------------------------------------------------------


class Checker:
    """Collects what a command needs checked; the expensive checks run in batches."""

    def __init__(self):
        self.bench: list[tuple[Command, str, list[str]]] = []
        self.errors: list[str] = []
        self.checked: set[str] = set()

    def fail(self, cmd: Command, why: str) -> None:
        self.errors.append(f"{cmd}\n    -> {why}")

    def check(self, cmd: Command) -> None:
        words = shlex.split(cmd.text)
        program, args = _program(words)
        rule = RULES.get(program)
        if program in EXTERNAL:
            self.checked.add(str(cmd))
            return
        if rule is None and program.startswith(("launch/", "slurm/", "bench/")):
            rule = check_repo_script
        if rule is None:
            self.fail(cmd, f"no rule for {program!r}: add one to this test, or to EXTERNAL with what it is")
            return
        self.checked.add(str(cmd))
        rule(self, cmd, program, args, _env(words))


def _iga_ds(checker: Checker, cmd: Command, args: list[str]) -> None:
    from iga_ds.cli import build_parser, main

    args, placeholder = _concrete(args)
    try:
        build_parser().parse_args(_sample(args))
    except SystemExit as exc:
        if exc.code:
            checker.fail(cmd, "iga-ds rejects these arguments (see its message above)")
        return
    if placeholder or not args:
        return
    if args[0] == "train" and "--help" not in args:
        with _as_user(cpu=False):
            code = main([*args] if "--dry-run" in args else [*args, "--dry-run"])
        if code != 0:
            checker.fail(cmd, f"iga-ds train --dry-run exited {code}")
    elif args[0] == "experiment" and "--grid" in args:
        code = main([*args, "--dry-run"])  # lists the cells; writes nothing
        if code != 0:
            checker.fail(cmd, f"iga-ds experiment --dry-run exited {code}")


def check_iga_ds(checker, cmd, program, args, env):
    _iga_ds(checker, cmd, args)


def _as_user(cpu: bool):
    """The environment a user's command sees: DS_ACCELERATOR=cpu only where the command (or the
    CPU template) sets it; a login node or a GPU node has none."""
    import contextlib
    import os

    @contextlib.contextmanager
    def scope():
        saved = os.environ.pop("DS_ACCELERATOR", None)
        if cpu:
            os.environ["DS_ACCELERATOR"] = "cpu"
        try:
            yield
        finally:
            os.environ.pop("DS_ACCELERATOR", None)
            if saved is not None:
                os.environ["DS_ACCELERATOR"] = saved

    return scope()


def _train_script(checker: Checker, cmd: Command, args: list[str], world: int = 1, cpu: bool = False) -> None:
    """``launch/train.py ARGS``: its parser, then, when the config is here, a dry run at the
    launcher's world size (unless the command asks for its own)."""
    import runpy

    args, placeholder = _concrete(args)
    script = runpy.run_path(str(REPO / "launch" / "train.py"))
    try:
        script["build_parser"]().parse_args(args)
    except SystemExit:
        return checker.fail(cmd, "launch/train.py rejects these arguments (see its message above)")
    config = args[args.index("--config") + 1] if "--config" in args else None
    if placeholder or config is None or not (REPO / config).is_file():
        return
    if "--dry-run" not in args:
        args = [*args, "--dry-run", "--world-size", str(world)]
    with _as_user(cpu):
        code = script["main"](args)
    if code != 0:
        checker.fail(cmd, f"launch/train.py {' '.join(args)} exited {code}")


def check_python(checker, cmd, program, args, env):
    if args[:2] == ["-m", "iga_ds"]:
        return _iga_ds(checker, cmd, args[2:])
    if args[:1] == ["-m"]:
        module = args[1]
        if module == "iga_ds.config.reference":
            return  # run by tests/config/test_configs.py::test_config_reference_is_up_to_date
        return checker.fail(cmd, f"no rule for python -m {module}")
    script = args[0]
    if script == "launch/train.py":
        return _train_script(checker, cmd, args[1:], cpu=env.get("DS_ACCELERATOR") == "cpu")
    if script.startswith("bench/"):
        return _bench_script(checker, cmd, script, args[1:])
    checker.fail(cmd, f"no rule for python {script}")


def _bench_script(checker: Checker, cmd: Command, script: str, args: list[str]) -> None:
    """A bench/ script's arguments, checked in a batch by its own parser (see _check_bench)."""
    if not (REPO / script).is_file():
        return checker.fail(cmd, f"{script} does not exist")
    checker.bench.append((cmd, script, _sample(_concrete(args)[0])))


def check_deepspeed(checker, cmd, program, args, env):
    from deepspeed.launcher.runner import parse_args

    args, _ = _concrete(args)
    script = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
    if script is None:
        return checker.fail(cmd, "deepspeed starts no script")
    try:
        parsed = parse_args([*args[:script], args[script]])
    except SystemExit:
        return checker.fail(cmd, "DeepSpeed's launcher rejects its options")
    if args[script].startswith("bench/"):  # the launcher hands each rank --local_rank
        return _bench_script(checker, cmd, args[script], [*args[script + 1:], "--local_rank=0"])
    if args[script] != "launch/train.py":
        return checker.fail(cmd, f"deepspeed starts {args[script]}, not launch/train.py or a bench/ script")
    world = parsed.num_gpus if parsed.num_gpus > 0 else 8  # a hostfile: 8 GPUs per host, one host
    _train_script(checker, cmd, args[script + 1:], world)


def check_torchrun(checker, cmd, program, args, env):
    from torch.distributed.run import get_args_parser

    args, _ = _concrete(args)
    try:
        parsed = get_args_parser().parse_args(args)
    except SystemExit:
        return checker.fail(cmd, "torchrun rejects its options")
    if parsed.module or not parsed.training_script.startswith("bench/"):
        return checker.fail(cmd, f"torchrun starts {parsed.training_script}, not a bench/ script")
    _bench_script(checker, cmd, parsed.training_script, parsed.training_script_args)


def check_srun(checker, cmd, program, args, env):
    for i, word in enumerate(args):
        if word in RULES and word != "srun":
            return RULES[word](checker, cmd, word, args[i + 1:], env)
        if word in EXTERNAL:
            return
    checker.fail(cmd, "srun starts no program this test knows")


def _sbatch_defaults(template: Path) -> tuple[dict[str, str], int]:
    text = template.read_text(encoding="utf-8")
    defaults = dict(re.findall(r"^(IGA_[A-Z_]+)=\$\{\1:-([^}]*)\}", text, flags=re.M))
    nodes = int((re.findall(r"^#SBATCH --nodes=(\d+)", text, flags=re.M) or ["1"])[0])
    per_node = re.findall(r"^#SBATCH --ntasks-per-node=(\d+)", text, flags=re.M)
    tasks = re.findall(r"^#SBATCH --ntasks=(\d+)", text, flags=re.M)
    return defaults, int(tasks[0]) if tasks else nodes * int((per_node or ["1"])[0])


def check_sbatch(checker, cmd, program, args, env):
    template = next((a for a in args if a.endswith(".sbatch")), None)
    if template is None or not (REPO / template).is_file():
        return checker.fail(cmd, f"sbatch submits {template!r}, not a template of slurm/")
    if template == "slurm/data_build_array.sbatch":  # a data build, run for real in tests/data/test_teacher_shards.py
        return _iga_ds(checker, cmd, ["data", "build", "--seeds", env["IGA_SEEDS"], "--out", env["IGA_OUT"],
                                      "--shard", "0/8", "--base-url", env["IGA_BASE_URL"], "--model", env["IGA_MODEL"],
                                      *shlex.split(env.get("IGA_BUILD_ARGS", ""))])
    options, overrides = args[:args.index(template)], args[args.index(template) + 1:]
    defaults, world = _sbatch_defaults(REPO / template)
    for option in options:
        m = re.match(r"^--(nodes|ntasks)=(\d+)$", option)
        if m:
            world = int(m.group(2)) * (8 if m.group(1) == "nodes" and "--ntasks" not in " ".join(options)
                                       and world > 1 and "cpu" not in template else 1)
    config = env.get("IGA_CONFIG", defaults.get("IGA_CONFIG"))
    if not (REPO / config).is_file():  # the user's own config: check the overrides on the default
        config = defaults["IGA_CONFIG"]
    ds = env.get("IGA_DS_CONFIG", defaults.get("IGA_DS_CONFIG"))
    _train_script(checker, cmd, ["--config", config, "--deepspeed", ds, *overrides], world,
                  cpu="DS_ACCELERATOR=cpu" in (REPO / template).read_text(encoding="utf-8"))


def check_repo_script(checker, cmd, program, args, env):
    path = REPO / program
    if not path.is_file():
        return checker.fail(cmd, f"{program} does not exist")
    if program == "launch/docker_run.sh":  # one node: 8 GPUs, or the ranks IGA_NUM_GPUS asks for
        return _train_script(checker, cmd, args, world=int(env.get("IGA_NUM_GPUS", 8)),
                             cpu=env.get("IGA_ACCELERATOR") == "cpu")
    if program == "launch/deepspeed_slurm.sh":  # one node of 8 GPUs
        return _train_script(checker, cmd, args, world=8)
    if program == "launch/mpirun.sh":
        if "--" not in args:
            return checker.fail(cmd, "launch/mpirun.sh needs -- before the command it starts")
        inner = args[args.index("--") + 1:]
        np_ = int(args[args.index("-np") + 1]) if "-np" in args else 1
        if inner[:2] == ["python", "launch/train.py"]:
            return _train_script(checker, cmd, inner[2:], np_)
        return checker.check(Command(cmd.where, shlex.join(inner)))
    if program == "launch/grid_parallel.sh":
        grid, placeholder = _concrete(args[:1])
        if not placeholder:
            _iga_ds(checker, cmd, ["experiment", "--grid", grid[0], "--out", "runs/x"])
        return
    if program == "bench/gpu_runs.sh":  # OUT_DIR, then stages, or a synopsis of them: [a|b|...]
        return _gpu_runs_stages(checker, cmd, [stage for word in args[1:] for stage in word.strip("[]").split("|")
                                               if stage and "..." not in stage])
    if program.startswith("bench/") and program.endswith(".py"):  # run as an executable
        return _bench_script(checker, cmd, program, args)
    if program.startswith("bench/") and program.endswith(".sh"):
        return  # their own dry runs are tested in tests/bench/test_node_runs.py
    checker.fail(cmd, f"no rule for {program}")


def _gpu_runs_stages(checker, cmd, stages) -> None:
    """bench/gpu_runs.sh needs GPUs to run; each stage named must be one its ``case`` knows
    (``stepN`` for ``step*)``)."""
    labels = gpu_runs_stages()
    for stage in stages:
        if not any(stage == label or (label.endswith("*") and re.fullmatch(re.escape(label[:-1]) + r"\d+", stage))
                   for label in labels):
            checker.fail(cmd, f"bench/gpu_runs.sh has no stage {stage!r}")


def check_bash(checker, cmd, program, args, env):
    if args and (REPO / args[0]).is_file():
        return check_repo_script(checker, cmd, args[0], args[1:], env)
    checker.fail(cmd, f"bash runs {args[:1]}, not a script of this repository")


def check_make(checker, cmd, program, args, env):
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M)
    for target in args:
        if "=" in target:  # NAME=VALUE sets a variable the Makefile must define
            name = target.split("=")[0]
            if not re.search(rf"^{re.escape(name)} *[?:]?=", makefile, flags=re.M):
                checker.fail(cmd, f"the Makefile defines no variable {name!r}")
        elif target not in targets:
            checker.fail(cmd, f"make has no target {target!r}")
    # and make itself reads the command line: a dry run (-n) prints what it would run, runs nothing
    dry = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    if dry.returncode != 0:
        checker.fail(cmd, f"make -n fails: {dry.stderr.strip()[-300:]}")


def check_docker(checker, cmd, program, args, env):
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    if args[0] == "build":
        for i, word in enumerate(args):
            if word == "--build-arg":
                name = args[i + 1].split("=")[0]
                if not re.search(rf"^ARG {name}\b", dockerfile, flags=re.M):
                    checker.fail(cmd, f"the Dockerfile has no ARG {name}")
        return
    if args[0] == "run":
        entry = re.findall(r'^ENTRYPOINT \["([^"]+)"', dockerfile, flags=re.M)
        image = next(i for i, a in enumerate(args[1:], 1) if not a.startswith("-") and not args[i - 1] in
                     ("-v", "--user", "-e", "--env", "--gpus", "-w"))
        inner = args[image + 1:]
        if entry and entry[-1] == "iga-ds":
            return _iga_ds(checker, cmd, inner)
        return checker.check(Command(cmd.where, shlex.join(inner)))
    checker.fail(cmd, f"no rule for docker {args[0]}")


RULES = {
    "iga-ds": check_iga_ds,
    "python": check_python,
    "python3": check_python,
    "deepspeed": check_deepspeed,
    "torchrun": check_torchrun,
    "srun": check_srun,
    "sbatch": check_sbatch,
    "bash": check_bash,
    "make": check_make,
    "docker": check_docker,
}

BENCH_PARSER = r"""
import argparse, json, os, runpy, sys
class Parsed(Exception):
    pass
real = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    real(self, args, namespace)
    raise Parsed()
argparse.ArgumentParser.parse_args = parse_then_stop
failed = []
for script, argv in json.loads(sys.argv[1]):
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python bench/x.py` sets it
    try:
        runpy.run_path(script, run_name="__main__")
        failed.append([script, argv, "ran past its argument parser"])
    except Parsed:
        pass
    except SystemExit as exc:
        if exc.code:
            failed.append([script, argv, f"its parser exited {exc.code}"])
print(json.dumps(failed))
"""


def _check_bench(checker: Checker) -> None:
    """Every bench command through its script's own parser, in one process."""
    if not checker.bench:
        return
    jobs = [list(job) for job in dict.fromkeys((script, tuple(argv)) for _, script, argv in checker.bench)]
    out = subprocess.run([sys.executable, "-c", BENCH_PARSER, json.dumps(jobs)], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for script, argv, why in json.loads(out.stdout.strip().splitlines()[-1]):
        for cmd in [c for c, s, a in checker.bench if s == script and a == argv]:
            checker.fail(cmd, why)


# -- the tests ---------------------------------------------------------------------------------


def test_every_fenced_block_says_its_language():
    untagged = [f"{path.relative_to(REPO)}:{line}" for path in DOCS
                for lang, line, _ in _fenced(path.read_text(encoding="utf-8")) if not lang]
    assert not untagged, "fenced blocks without a language (bash for commands, text for the rest): " \
        + ", ".join(untagged)


def test_no_indented_code_blocks():
    indented = [f"{path.relative_to(REPO)}:{line}" for path in DOCS
                for line, _ in _indented(path.read_text(encoding="utf-8"))]
    assert not indented, "indented code blocks (make them fenced blocks that say their language): " \
        + ", ".join(indented)


def test_indented_blocks_are_told_from_list_text():
    text = "Run:\n\n    python a.py\n    python b.py\n\n- item\n  more\n\n    the item's second paragraph\n" \
           "\n```bash\n    inside a fence\n```\nText\n\n    python c.py\n"
    assert _indented(text) == [(3, "python a.py\npython b.py\n"), (16, "python c.py\n")]


def test_inline_spans_that_are_commands():
    commands = ["sbatch --nodes=2 slurm/cpu.sbatch", "launch/mpirun.sh -np 2 -- iga-ds selfcheck", "make demo",
                "DS_ACCELERATOR=cpu python bench/bench_step.py --steps 2", "iga-ds data validate train.jsonl"]
    names = ["deepspeed", "deepspeed --launcher slurm", "sbatch --ntasks=2", "srun --container-image", "iga-ds eval",
             "iga-ds data merge", "launch/mpirun.sh", "IGA_SHARDS=8 sbatch --array=3 ...", "vllm serve x",
             "iga-ds selfcheck: FAILED on rank R/W (host): reason"]
    assert [c for c in commands if not _inline_command(c)] == []
    assert [n for n in names if _inline_command(n)] == []


def test_commands_are_found_in_every_kind_of_place():
    where = {str(c).split(":")[0].split(" ")[0] for c in doc_commands() + header_commands()}
    assert {"README.md", "bench/README.md", "docs/TRAINING.md", "docs/CLUSTER.md", "slurm/cpu.sbatch",
            "launch/docker_run.sh", "configs/tiny_cpu.yaml"} <= where
    # the pages split out of TRAINING, DATA, EVALUATION and CLUSTER keep their commands checked
    assert {"docs/MODELS.md", "docs/TEACHER.md", "docs/EXPERIMENTS.md", "docs/DOCKER.md",
            "docs/LAUNCHER_TESTS.md"} <= where


def test_gpu_runs_commands_are_read_with_the_scripts_defaults():
    commands = {c.where: c.text for c in gpu_runs_commands()}
    assert commands["bench/gpu_runs.sh (targets*)"] == (
        "python bench/bench_step.py --gpus 1 --methods erm,iga_bf16 --rounds 2 --steps 16 "
        "--out OUT/bench_step_1gpu_targets.json")
    assert "--model RULE_MODEL" in commands["bench/gpu_runs.sh (rule)"]
    assert all("$" not in text for text in commands.values())
    assert len(commands) >= 6  # one per stage that runs a benchmark (two in capture: the last kept)


def test_gpu_runs_checks_stage_runs_every_gpu_test_file():
    """A new test file with GPU tests must be named in gpu_runs.sh's ``checks`` stage, or the
    GPU sessions that run that stage never run it."""
    marked = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")
              if re.search(r"^(@pytest\.mark\.gpu|pytestmark = .*\bgpu\b)", p.read_text(encoding="utf-8"), re.M)}
    named = set(re.findall(r"tests/(?:\w+/)?test_\w+\.py", gpu_runs_stages()["checks"]))
    assert marked and marked <= named, sorted(marked - named)


def test_every_documented_command_runs_or_parses(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    checker = Checker()
    commands = doc_commands() + header_commands() + gpu_runs_commands()
    for cmd in commands:
        try:
            checker.check(cmd)
        except Exception as exc:  # a rule that crashes is a failure of that command
            checker.fail(cmd, f"{type(exc).__name__}: {exc}")
    _check_bench(checker)
    print(f"{len(checker.checked)} of {len(commands)} commands checked")
    assert not checker.errors, "\n".join(checker.errors)
    assert {str(c) for c in commands} <= checker.checked and len(commands) >= 150
