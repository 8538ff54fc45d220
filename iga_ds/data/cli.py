"""``iga-ds data``: validate, synth, build, merge, split, export.

``data build`` and ``data merge`` import the teacher pipeline, which loads httpx, when they
run, not when the parser is built: that keeps ``iga-ds --help`` and every other command's
start-up fast.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from iga_ds.data.domains import DEFAULT_DOMAINS, parse_domain_list
from iga_ds.data.patterns import PATTERNS
from iga_ds.data.schema import check_groups, check_no_leak, read_isomer_jsonl, read_source, summarize
from iga_ds.data.sources import write_dataset
from iga_ds.data.splits import LEAKAGE_WARNING, split_by_instance, split_by_seed
from iga_ds.data.synth import TEST_CUES, parse_shortcut_by_domain, synthesize
from iga_ds.data.teacher.prompts import Prompts
from iga_ds.data.teacher.shards import parse_shard, shard_dir
from iga_ds.errors import UserError
from iga_ds.files import atomic_write_json, atomic_write_text, check_output_dir, check_output_file


def register(subparsers) -> None:
    """Add ``iga-ds data`` and its subcommands to the top-level parser."""
    data = subparsers.add_parser("data", help="isomer data: validate, synthesize, build with a teacher, split, export",
                                 description="Logical Isomer Sets: create, check and split data files.")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    # a bare ``iga-ds data`` prints its help and exits 2, like a usage error
    data.set_defaults(func=lambda args: (data.print_help(), 2)[1])
    _add_validate(sub)
    _add_synth(sub)
    _add_build(sub)
    _add_merge(sub)
    _add_split(sub)
    _add_export(sub)


def _add_validate(sub) -> None:
    """``iga-ds data validate``."""
    p = sub.add_parser("validate", help="check isomer sets (JSONL, Parquet, Arrow, saved datasets, hub ids) "
                                        "and print a summary",
                       description="Check schema, group completeness, one answer type per group, and "
                                   "that no seed appears in two files (e.g. train and test). A FILE is a JSON "
                                   "Lines file, a .parquet or .arrow file, a folder written by datasets' "
                                   "save_to_disk, or a Hugging Face hub id org/name[@revision][:split].")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--domains", help="the run's domains (its data.domains), e.g. math,medical,legal,science: every "
                                     "group needs each once and no other (default: the domains most groups have)")
    p.add_argument("--allow-partial-groups", action="store_true",
                   help="accept groups missing domains (files of an instance-level split)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_validate)


def _add_synth(sub) -> None:
    """``iga-ds data synth``."""
    p = sub.add_parser("synth", help="generate procedural isomer groups (no LLM needed)",
                       description="Sample typed logical DAGs, solve them by forward chaining and render "
                                   "each in every domain; writes train.jsonl, test.jsonl, manifest.json.")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--groups", type=int, required=True, help="number of isomer groups")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--domains", help="comma-separated (default math,medical,legal,science)")
    p.add_argument("--shortcut", type=float, default=0.0,
                   help="probability that the planted domain cue predicts the answer in train, the same in "
                        "every domain (0 plants no cue; in test the cue is independent of the answer)")
    p.add_argument("--shortcut-by-domain", metavar="DOMAIN=P,...",
                   help="per-domain probability that the cue predicts the answer in train, one for every "
                        "domain, e.g. math=1.0,medical=0.9,legal=0.7,science=0.3 (replaces --shortcut)")
    p.add_argument("--test-cue", choices=TEST_CUES, default="independent",
                   help="the cue in test: independent of the answer (default) or adversarial (always wrong)")
    p.add_argument("--patterns", help="comma-separated subset of rule_chain,conjunction,syllogism,arithmetic")
    p.add_argument("--min-depth", type=int, default=1)
    p.add_argument("--max-depth", type=int, default=4)
    p.add_argument("--test-frac", type=float, default=0.2, help="fraction of groups (seeds) in test")
    p.add_argument("--neutral-cue", action="store_true",
                   help="render the cue sentence everywhere with a slot word independent of the answer "
                        "(shows the cue words without planting a shortcut; needs --shortcut 0)")
    p.add_argument("--answer-only", action="store_true",
                   help="leave cot empty: the training target is the answer line alone")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_synth)


def _add_build(sub) -> None:
    """``iga-ds data build``: the teacher, its server, the filters and the HTTP retries."""
    p = sub.add_parser("build", help="build isomer groups from seed problems with a teacher LLM",
                       description="DAG extraction, domain instantiation and verification with a teacher "
                                   "LLM, the score and step-count filters, regeneration; resumable.")
    p.add_argument("--seeds", required=True, help="JSONL of seed problems: seed_id (or id), problem")
    p.add_argument("--out", required=True, help="output directory (rerun with the same to resume)")
    p.add_argument("--teacher", choices=("openai", "local"), default="openai",
                   help="openai: any OpenAI-compatible chat-completions server (vLLM, TGI, hosted); "
                        "local: a transformers causal LM in this process")
    p.add_argument("--base-url", help="server URL up to /v1, e.g. http://localhost:8000/v1 (openai)")
    p.add_argument("--model", required=True, help="model name on the server, or a local directory (local)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the API key (default OPENAI_API_KEY; unset: no key)")
    p.add_argument("--api-key-file", help="file holding the API key (overrides --api-key-env)")
    p.add_argument("--concurrency", type=int, default=8, help="seeds (and requests) in flight")
    p.add_argument("--shard", metavar="I/N",
                   help="build only shard I (from 0) of N: the seeds whose id hashes to I, into OUT/shard-I-of-N; "
                        "`iga-ds data merge` joins the N shards")
    p.add_argument("--min-score", type=float, default=0.85)
    p.add_argument("--max-step-diff", type=int, default=2)
    p.add_argument("--max-regenerations", type=int, default=3)
    p.add_argument("--outliers", choices=("discard", "regenerate"), default="discard",
                   help="a group whose step counts differ by more than --max-step-diff, whose solutions do "
                        "not follow the DAG's dependencies or whose answer types differ: discard it (the "
                        "paper, default), or regenerate the outlying instance up to --max-regenerations "
                        "times (departs from the paper: keeps groups the paper drops)")
    p.add_argument("--structure-check", choices=("dag", "verdict"), default="dag",
                   help="how a solution's dependency structure is checked: dag (default): each step's "
                        "uses/derives nodes against the DAG; verdict: the teacher's own verification verdict, "
                        "as the paper does, for teachers that do not annotate their steps")
    p.add_argument("--stop-unannotated", type=int, default=8, metavar="K",
                   help="stop (nothing dropped) when the first K seeds to reach the structure check all fail "
                        "it as structure_unannotated (default 8; 0: never stop)")
    p.add_argument("--domains", help="comma-separated (default math,medical,legal,science)")
    p.add_argument("--templates", help="directory with edited dag_extraction.txt, domain_instantiation.txt, "
                                       "quality_verification.txt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per HTTP request")
    p.add_argument("--max-retries", type=int, default=6, help="HTTP retries on 429/5xx/timeouts")
    p.add_argument("--backoff", type=float, default=1.0, help="first retry delay in seconds (doubles)")
    p.add_argument("--no-json-mode", action="store_true",
                   help="never ask the server for JSON mode (response_format); by default the prompts that ask "
                        "for JSON ask for it, and a server that refuses it is asked without")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_build)


def _add_merge(sub) -> None:
    """``iga-ds data merge``."""
    p = sub.add_parser("merge", help="join the shards of a build (--shard I/N) into one output",
                       description="Check the shard folders OUT/shard-I-of-N of a sharded build: all N there, "
                                   "built with the same settings, finished, every seed of the seeds file "
                                   "exactly once in the shard it belongs to. Then write isomers.jsonl, "
                                   "dropped.jsonl, build.json and stats.json into OUT, as an unsharded build "
                                   "would, each file whole or not at all.")
    p.add_argument("--seeds", required=True, help="the seeds file the shards were built from")
    p.add_argument("--out", required=True, help="the --out the shards were built with")
    p.set_defaults(func=cmd_merge)


def _add_split(sub) -> None:
    """``iga-ds data split``."""
    p = sub.add_parser("split", help="split an isomer file into train.jsonl and test.jsonl",
                       description="Seed-level split (the default and the only sound one), or an "
                                   "instance-level split for the leakage ablation.")
    p.add_argument("--in", dest="input", required=True, metavar="FILE",
                   help="an isomer set: JSONL, Parquet, Arrow, a save_to_disk folder or a hub id")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--by", choices=("seed", "instance"), default="seed")
    p.add_argument("--test-frac", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_split)


def _add_export(sub) -> None:
    """``iga-ds data export``."""
    p = sub.add_parser("export", help="write a checked isomer set as Parquet, a saved dataset or JSONL",
                       description="Read an isomer set from any source (JSONL, Parquet, Arrow, a save_to_disk "
                                   "folder, a hub id), check it as `data validate` does, and write it as one "
                                   "Parquet file, a folder of datasets' save_to_disk (load_from_disk reads it), "
                                   "or JSON Lines. dag and meta are stored as JSON text. The output appears "
                                   "whole or not at all (written under a temporary name, then renamed).")
    p.add_argument("input", metavar="IN")
    p.add_argument("--out", required=True, help="the Parquet or JSONL file, or the dataset folder, to write")
    p.add_argument("--format", choices=("dataset", "parquet", "jsonl"), required=True)
    p.add_argument("--allow-partial-groups", action="store_true",
                   help="accept groups missing domains (files of an instance-level split)")
    p.set_defaults(func=cmd_export)


def cmd_validate(args) -> int:
    files = {}
    domains = parse_domain_list(args.domains) if args.domains is not None else None
    for path in args.files:
        source, records, lines = read_source(path)
        check_groups(records, lines, source, allow_partial=args.allow_partial_groups, domains=domains)
        files[source] = (records, lines)
    check_no_leak(files)
    report = {}
    for source, (records, _) in files.items():
        path = source.spec
        summary = summarize(records)
        stats = Path(path).parent / "stats.json"
        if source.kind != "hub" and stats.exists():
            try:
                summary["retention"] = json.loads(stats.read_text(encoding="utf-8")).get("retention")
            except ValueError:
                pass
        report[path] = summary
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    for path, s in report.items():
        _print_summary(path, s)
        if domains is None and sorted(s["domains"]) != sorted(DEFAULT_DOMAINS):
            # checked against the file's own domains only: a run on the default ones would miss some
            print(f"note: {path}: its domains are {', '.join(s['domains'])}; a run without data.domains trains on "
                  f"{', '.join(DEFAULT_DOMAINS)} (every group needs each): check against your run's with --domains")
    if len(files) > 1:
        print(f"no seed or group shared between the {len(files)} files")
    return 0


def _print_summary(path: str, s: dict) -> None:
    """The OK line of one validated file."""
    line = (f"{path}: OK  {s['groups']} groups, {s['instances']} instances, "
            f"{s['seeds']} seeds, domains " + ", ".join(f"{d}={n}" for d, n in s["domains"].items())
            + ", answers " + ", ".join(f"{t}={n}" for t, n in s["answer_types"].items()))
    if "retention" in s and s["retention"] is not None:
        line += f", retention {s['retention']:.1%}"
    if "cue_agreement" in s:
        line += f", cue agrees with answer in {s['cue_agreement']:.1%}"
    print(line)


def cmd_synth(args) -> int:
    check_output_dir(args.out)
    patterns = tuple(p.strip() for p in args.patterns.split(",")) if args.patterns is not None else PATTERNS
    by_domain = None
    if args.shortcut_by_domain is not None:
        if args.shortcut != 0.0:
            raise UserError(f"--shortcut {args.shortcut} with --shortcut-by-domain: the per-domain probabilities "
                            "replace it; expected only one of the two")
        by_domain = parse_shortcut_by_domain(args.shortcut_by_domain)
    manifest = synthesize(args.out, args.groups, args.seed, parse_domain_list(args.domains), args.shortcut,
                          patterns=patterns, min_depth=args.min_depth, max_depth=args.max_depth,
                          test_frac=args.test_frac, progress=not args.no_progress,
                          neutral_cue=args.neutral_cue, answer_only=args.answer_only,
                          shortcut_by_domain=by_domain, test_cue=args.test_cue)
    for split in ("train", "test"):
        s = manifest["splits"][split]
        extra = f", cue agreement {s['cue_agreement']:.1%}" if s.get("cue_agreement") is not None else ""
        if by_domain is not None and s["instances"]:
            extra += " (" + ", ".join(f"{d} {v:.1%}" for d, v in s["cue_agreement_by_domain"].items()) + ")"
        print(f"{Path(args.out) / (split + '.jsonl')}: {s['groups']} groups, {s['instances']} instances{extra}")
    print(f"{Path(args.out) / 'manifest.json'}")
    return 0


# (option, lowest allowed, whether the lowest itself is allowed) of `data build`'s numbers
_BUILD_BOUNDS = (("concurrency", 1, True), ("min_score", 0.0, True), ("max_step_diff", 0, True),
                 ("max_regenerations", 0, True), ("temperature", 0.0, True), ("max_tokens", 1, True),
                 ("timeout", 0.0, False), ("max_retries", 0, True), ("backoff", 0.0, True),
                 ("stop_unannotated", 0, True))


def _check_build_options(args) -> None:
    """Each number of ``data build`` in its range: a one-line error naming the option."""
    for name, low, inclusive in _BUILD_BOUNDS:
        value = getattr(args, name)
        option = "--" + name.replace("_", "-")
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            relation = ">=" if inclusive else ">"
            raise UserError(f"{option} {value}: expected a number {relation} {low:g}")
    if args.min_score > 1.0:
        raise UserError(f"--min-score {args.min_score}: expected a number in [0, 1]")
    if args.shard is not None:
        parse_shard(args.shard)


def _teacher_client(args, counters):
    """The client of ``--teacher`` and how many seeds it takes at once."""
    from iga_ds.data.teacher.clients import LocalCausalLMClient, OpenAIChatClient, resolve_api_key

    if args.teacher == "local":
        client = LocalCausalLMClient(args.model, max_new_tokens=args.max_tokens,
                                     temperature=args.temperature, counters=counters)
        return client, 1  # one model in this process: requests run one after another
    if not args.base_url:
        raise UserError("--base-url is required with --teacher openai (e.g. http://localhost:8000/v1)")
    client = OpenAIChatClient(args.base_url, args.model, api_key=resolve_api_key(args.api_key_env, args.api_key_file),
                              temperature=args.temperature, max_tokens=args.max_tokens, timeout=args.timeout,
                              max_retries=args.max_retries, backoff=args.backoff, counters=counters,
                              json_mode=not args.no_json_mode)
    return client, args.concurrency


def _print_build_stats(out, stats: dict) -> int:
    """The summary of a build; 1 (with what is left and why) when seeds are still to do."""
    retention = f"{stats['retention']:.1%}" if stats["retention"] is not None else "n/a"
    print(f"{out}: kept {stats['kept_groups']} groups, dropped {stats['dropped_groups']}, "
          f"retention {retention} (paper: 78%), pending {stats['pending_seeds']}")
    if stats["drop_reasons"]:
        print("drop reasons: " + ", ".join(f"{k}={v}" for k, v in stats["drop_reasons"].items()))
    if not stats["pending_seeds"]:
        return 0
    why = (f" (this run: {stats['failed_this_run']} failed after retries, {stats['refused_this_run']} refused "
           f"by the server; last: {stats['last_error']})") if stats["last_error"] else ""
    print(f"{stats['pending_seeds']} seeds still to do{why}; run the same command again to resume", file=sys.stderr)
    return 1


def cmd_build(args) -> int:
    from iga_ds.data.teacher.clients import Counters
    from iga_ds.data.teacher.pipeline import BuildSettings, build

    check_output_dir(args.out)
    _check_build_options(args)
    counters = Counters()
    prompts = Prompts(args.templates)
    client, concurrency = _teacher_client(args, counters)
    settings = BuildSettings(domains=list(parse_domain_list(args.domains)), min_score=args.min_score,
                             max_step_diff=args.max_step_diff, max_regenerations=args.max_regenerations,
                             teacher=args.teacher, model=args.model, outliers=args.outliers,
                             structure_check=args.structure_check)
    try:
        stats = build(args.seeds, args.out, client, settings, prompts=prompts, concurrency=concurrency,
                      counters=counters, progress=not args.no_progress, shard=args.shard,
                      stop_unannotated=args.stop_unannotated)
    finally:
        getattr(client, "close", lambda: None)()
    out = shard_dir(args.out, *parse_shard(args.shard)) if args.shard else args.out
    return _print_build_stats(out, stats)


def cmd_merge(args) -> int:
    from iga_ds.data.teacher.merge import merge_shards

    stats = merge_shards(args.seeds, args.out)
    retention = f"{stats['retention']:.1%}" if stats["retention"] is not None else "n/a"
    print(f"{args.out}: merged {stats['merged_shards']} shards: {stats['seeds']} seeds, each exactly once; kept "
          f"{stats['kept_groups']} groups ({stats['kept_instances']} instances), dropped {stats['dropped_groups']}, "
          f"retention {retention}")
    return 0


def cmd_split(args) -> int:
    check_output_dir(args.out)
    records = read_isomer_jsonl(args.input, allow_partial_groups=False)
    if args.by == "seed":
        train, test = split_by_seed(records, args.test_frac, args.seed)
    else:
        print(f"warning: {LEAKAGE_WARNING}", file=sys.stderr)
        train, test = split_by_instance(records, args.test_frac, args.seed)
    out = Path(args.out)
    for name, part in (("train", train), ("test", test)):
        atomic_write_text(out / f"{name}.jsonl",
                          "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
    info = {"input": str(args.input), "by": args.by, "test_frac": args.test_frac, "seed": args.seed,
            "train_instances": len(train), "test_instances": len(test),
            "train_seeds": len({r["seed_id"] for r in train}),
            "test_seeds": len({r["seed_id"] for r in test})}
    if args.by == "instance":
        info["warning"] = LEAKAGE_WARNING
    atomic_write_json(out / "split.json", info)
    print(f"{out}: train {len(train)} instances ({info['train_seeds']} seeds), "
          f"test {len(test)} instances ({info['test_seeds']} seeds), by {args.by}")
    return 0


def cmd_export(args) -> int:
    (check_output_dir if args.format == "dataset" else check_output_file)(args.out)
    records = read_isomer_jsonl(args.input, allow_partial_groups=args.allow_partial_groups)
    out = write_dataset(records, args.out, args.format)
    groups = len({r["group_id"] for r in records})
    print(f"{out}: {len(records)} records, {groups} groups ({args.format})")
    return 0
