"""The ``magicpig-jax`` command line.

Subcommands:
  generate          answer a question over a long document, MagicPIG and dense
  convert           a model as one orbax checkpoint folder (weights, tokenizer)
  bench attention   one layer's decode attention: host op, XLA dense, reference
  bench decode      end-to-end decode tokens/s per prompt length and batch
  study attention   estimator error versus cost (TopK, Quest, oracle, MagicPIG)
  eval              RULER-style accuracy and long-text likelihood versus cost
  calibrate         per-layer (K, L) or dense meeting a KL budget at least cost
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import signal
import sys
import threading
import time
from pathlib import Path

from magicpig_jax.argparsing import Parser, check_output, in_flag_terms, model_input, path_arg

__all__ = ["main", "DEMO_DOCUMENT", "DEMO_QUESTION"]

DEMO_DOCUMENT = Path(__file__).parent / "data" / "lgpl-2.1.txt"
DEMO_QUESTION = "What is the name of the example company in the appendix that disclaims copyright?"
MODEL_HELP = ("a .gguf file, a Hugging Face directory (config.json + *.safetensors + tokenizer.json), or an "
              "orbax checkpoint directory written by `magicpig-jax convert` (default, or 'embedded': the embedded "
              "SmolLM2-135M-Instruct)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def _budget(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"--budget takes an int or a float, got {text!r}") from err


# The backends generate takes: models.backends.BACKENDS (a test keeps the two in step; importing the
# table here would import JAX for every command, --help included).
GENERATE_BACKENDS = "dense, magicpig, magicpig-ref, topk, quest, oracle, hybrid"


def _attention_list(text: str) -> list[str]:
    from magicpig_jax.models.backends import BACKENDS

    names = [x.strip() for x in text.split(",")]
    if "" in names and text.strip():
        raise argparse.ArgumentTypeError(f"lists an empty entry, got {text!r}")
    names = [n for n in names if n]
    allowed = BACKENDS
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"takes a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # one answer per backend: a repeat would be decoded once, silently
        raise argparse.ArgumentTypeError(f"lists {', '.join(twice)} more than once, got {text!r}")
    return names


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", description="Answer a question over a long document (MagicPIG next to dense).")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--document", type=path_arg, default=None,
                   help=f"text file to read (default: the bundled {DEMO_DOCUMENT.name}, ~5.9K tokens)")
    p.add_argument("--question", default=None, help=f"question about the document (default: {DEMO_QUESTION!r})")
    p.add_argument("--prompt", default=None, help="a raw user message instead of --document/--question")
    p.add_argument("--attention", type=_attention_list, default=["dense", "magicpig"],
                   help=f"comma-separated backends to decode with, in order, sharing one prefill "
                        f"({GENERATE_BACKENDS}); the last decodes in the prefill's own cache, the others in copies "
                        "(default: dense,magicpig)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate at most")
    p.add_argument("--K", type=int, default=None,
                   help="SimHash bits per table (1..16 with the host op, 1..32 with magicpig-ref; default 10)")
    p.add_argument("--L", type=int, default=None, help="hash tables (>= 2; default 150; at most 4096 on the host op)")
    p.add_argument("--heavy", type=int, default=None,
                   help="hybrid only: keys colliding in at least this many tables are kept exactly, the rest "
                        "importance-weighted (3 <= heavy <= L + 1; default 8)")
    p.add_argument("--num-sink", type=int, default=None, help="sink tokens kept exactly (default 4)")
    p.add_argument("--num-local", type=int, default=None, help="local window of the prompt kept exactly (default 64)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the SimHash projections, of oracle sampling and of token sampling (default 0)")
    p.add_argument("--layers-per-projection", type=int, default=None,
                   help="consecutive layers sharing one SimHash projection matrix (default 1: one per layer; "
                        "the reference implementation uses 16)")
    p.add_argument("--dense-layers", type=_int_list, default=None,
                   help="layers kept dense under MagicPIG (default: 0 and num_layers // 2)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, in (0, 1]")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, matched as typed (repeat for several; a newline is $'\\n' in bash)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--parse-special", action="store_true",
                   help="special-token strings in the prompt become control tokens (raw prompts)")
    p.add_argument("--budget", type=_budget, default=None,
                   help="keys per query head for topk/quest/oracle: a token count (int) or a fraction in (0, 1]")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="storage of the KV cache (default bfloat16: half the bytes; docs/benchmarks.md gives its "
                        "KL from a float32 cache)")
    p.add_argument("--magicpig-config", type=path_arg, default=None,
                   help="per-layer (K, L) or dense from `magicpig-jax calibrate` for magicpig/magicpig-ref/hybrid "
                        "(the file gives those backends' K, L, sinks, local window, SimHash seed and dense layers: "
                        "--K, --L, --layers-per-projection, --heavy and --dense-layers are refused beside it, and "
                        "--num-sink "
                        "and --num-local then apply to topk/quest/oracle only)")
    p.add_argument("--json", type=path_arg, default=None,
                   help="also write the results as JSON here (token_ids hold the EOS or stop-string token that "
                        "ended a row; text is cut before it)")
    p.set_defaults(func=_cmd_generate)


def build_prompt(document: str, question: str) -> str:
    """The user message of the demo: the question, the document, the question again."""
    return (f"Read the document and answer the question.\n\nQuestion: {question}\n\n"
            f"Document:\n{document}\n\nQuestion: {question}")


def _read_document(path: Path) -> str:
    if path.is_dir():
        raise ValueError(f"--document {path} is a directory; give a text file")
    if not path.exists():
        raise FileNotFoundError(f"--document {path} does not exist")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--document {path} is not UTF-8 text: byte {err.start} is {data[err.start]:#04x}") from None
    if not text.strip():
        raise ValueError(f"--document {path} is empty")
    return text


def _generate_prompt(args) -> str:
    """The user message: ``--prompt``, or the question over ``--document`` (checked before loading)."""
    for flag, text in (("--prompt", args.prompt), ("--question", args.question)):
        if text is not None and any("\ud800" <= c <= "\udfff" for c in text):
            raise ValueError(f"{flag} is not valid UTF-8 text")
    if args.prompt is not None:
        if args.document is not None or args.question is not None:
            raise ValueError("--prompt cannot be combined with --document/--question")
        if not args.prompt.strip():
            raise ValueError("--prompt is empty")
        return args.prompt
    if args.question is not None and not args.question.strip():
        raise ValueError("--question is empty")
    document = _read_document(args.document or DEMO_DOCUMENT)
    return build_prompt(document, args.question or DEMO_QUESTION)


def _cmd_generate(args) -> int:
    from magicpig_jax.attention import HybridConfig, MagicPIGConfig
    from magicpig_jax.generation import Sampling, cache_capacity, decode_spec, encode_prompt, kv_cache_dtype, prefill
    from magicpig_jax.host.index import HOST_MAX_K
    from magicpig_jax.io.loader import load_model
    from magicpig_jax.memory import drop_compiled_programs
    from magicpig_jax.models.backends import BUDGETED, LAYERED, DecodeSpec
    from magicpig_jax.streaming import check_stop_strings, check_stops_for

    # Every argument is checked before the model is loaded (the layer range against its metadata).
    given = {name for name in (*_GENERATE_DEFAULTS, "dense_layers") if getattr(args, name) is not None}
    for name, default in _GENERATE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if "heavy" not in given and isinstance(args.L, int) and args.L >= 2:
        args.heavy = min(args.heavy, args.L + 1)  # the default within [3, L + 1] for few tables
    if "magicpig" in args.attention and isinstance(args.K, int) and args.K > HOST_MAX_K:
        raise ValueError(f"--K must be in [1, {HOST_MAX_K}] with attention 'magicpig' (the host index: 2^K + 1 "
                         f"bucket offsets per chunk and table), got {args.K}; 'magicpig-ref' (pure JAX) takes up to 32")
    with in_flag_terms(K="--K", L="--L", num_sink="--num-sink", num_local="--num-local", seed="--seed",
                       layers_per_projection="--layers-per-projection", temperature="--temperature",
                       top_p="--top-p", heavy="--heavy"):
        config = MagicPIGConfig(K=args.K, L=args.L, num_sink=args.num_sink, num_local=args.num_local,
                                seed=args.seed, layers_per_projection=args.layers_per_projection)
        sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        hybrid = HybridConfig(**dataclasses.asdict(config), heavy=args.heavy) if "hybrid" in args.attention else None
    _check_options_used(args, given)
    try:
        stops = check_stop_strings(args.stop)
    except ValueError as err:
        raise ValueError(f"--stop: {err}") from None
    needs_budget = [a for a in args.attention if a in BUDGETED]
    if needs_budget and args.budget is None:
        raise ValueError(f"attention {needs_budget[0]!r} needs a budget: pass --budget TOKENS or --budget FRACTION")
    if args.budget is not None and not needs_budget:
        raise ValueError(f"--budget applies to attention {', '.join(BUDGETED)} only, none of which is in --attention")
    if args.magicpig_config is not None and not set(LAYERED) & set(args.attention):
        raise ValueError("--magicpig-config applies to attention magicpig, magicpig-ref and hybrid, none of which is "
                         "in --attention")

    def budget(name):
        return args.budget if name in BUDGETED else None

    def config_of(name):
        return hybrid if name == "hybrid" else config

    try:
        checked = [DecodeSpec(backend=name, magicpig=config_of(name), budget=budget(name)) for name in args.attention]
    except ValueError as err:
        if str(err).startswith("budget "):
            raise ValueError("--" + str(err).replace(f"got budget={args.budget!r}", f"got {args.budget!r}")) from None
        raise
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if any(i < 0 for i in args.dense_layers or ()):
        raise ValueError(f"--dense-layers must be layer indices >= 0, got {','.join(map(str, args.dense_layers))}")
    if args.json is not None:
        check_output("--json", args.json, "file",
                     inputs={"--document": args.document, "--magicpig-config": args.magicpig_config,
                             "--model": model_input(args.model)})
    layered = _layer_configs(args)
    prompt = _generate_prompt(args)
    _check_model(args, layered)
    print("attention: " + "; ".join(f"{spec.backend} ({_runs_on(spec)})" for spec in checked), flush=True)
    model = load_model(args.model)
    print(f"model: {model.source} ({model.config.num_layers} layers, loaded in {model.load_seconds:.1f} s)")
    _note_generation_settings(model)
    if args.magicpig_config is not None:
        from magicpig_jax.eval.calibrate import other_model_note

        note = other_model_note(args.magicpig_config, model.source)
        if note:
            print(f"magicpig-jax: note: generate: {note}", file=sys.stderr, flush=True)
    try:
        check_stops_for(model.tokenizer, stops)
    except ValueError as err:
        raise ValueError(f"--stop: {err}") from None
    ids = encode_prompt(model, prompt, chat=not args.no_chat, parse_special=args.parse_special)
    if len(ids) > model.config.max_position_embeddings:  # (prefill refuses it too, after announcing itself)
        raise ValueError(f"prompt has {len(ids)} tokens, longer than the model's context of "
                         f"{model.config.max_position_embeddings} tokens")
    positions = cache_capacity(model, len(ids), args.max_new_tokens)  # sliding windows shorter than this bind
    specs = {name: decode_spec(model, name, config_of(name), args.dense_layers, budget(name), positions=positions)
             if layered is None or name not in LAYERED
             else decode_spec(model, name, layered, positions=positions)
             for name in args.attention}
    print(f"prompt: {len(ids)} tokens; prefilling (dense, chunked) ...", flush=True)
    state = prefill(model, [ids], args.max_new_tokens, cache_dtype=kv_cache_dtype(args.kv_dtype))
    drop_compiled_programs()  # one-shot: the prefill's program will not run again (memory.py)
    run_s = max(state.seconds - state.compile_seconds, 1e-9)
    print(f"prefill: {state.seconds:.1f} s ({state.compile_seconds:.1f} s compiling, then "
          f"{len(ids) / run_s:.0f} tokens/s)")
    last = list(specs)[-1]  # decodes in the prefill's own cache (the others in copies of it)
    results = {name: _stream_answer(model, state, spec, args.max_new_tokens, sampling, stops, name == last)
               for name, spec in specs.items()}
    print(_summary(results, len(ids), state.seconds))
    if len(results) > 1:
        texts = {n: r["text"].strip() for n, r in results.items()}
        same = len(set(texts.values())) == 1
        print(f"answers identical across backends: {'yes' if same else 'no'}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from magicpig_jax.memory import peak_rss_bytes

        args.json.write_text(json.dumps({"model": str(model.source), "prompt_tokens": len(ids),
                                         "kv_dtype": args.kv_dtype,
                                         "prefill_seconds": state.seconds,
                                         "prefill_compile_seconds": state.compile_seconds,
                                         "peak_rss_bytes": peak_rss_bytes(), "results": results},
                                        indent=2, allow_nan=False))
        print(f"wrote {args.json}")
    return 0


_GENERATE_DEFAULTS = {"K": 10, "L": 150, "num_sink": 4, "num_local": 64, "seed": 0, "layers_per_projection": 1,
                      "heavy": 8}


def _note_generation_settings(model) -> None:
    """Name the sampling a Hugging Face model's generation_config.json recommends, which generate does
    not apply (:func:`magicpig_jax.io.hf_model.recommended_generation_settings`)."""
    from magicpig_jax.io.checkpoint import is_checkpoint
    from magicpig_jax.io.hf_model import recommended_generation_settings

    source = Path(model.source)
    if not source.is_dir() or is_checkpoint(source):
        return
    settings = recommended_generation_settings(source)
    if settings:
        listed = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        print(f"magicpig-jax: note: generate: {source / 'generation_config.json'} recommends {listed}; generate does "
              "not apply them: it decodes greedily unless --temperature/--top-p say otherwise, with no repetition "
              "penalty, suppressed tokens or beams", file=sys.stderr, flush=True)


def _check_options_used(args, given: set[str]) -> None:
    """Refuse an option that no backend in ``--attention`` reads (it would be recorded yet have no effect).
    The LSH options and a calibrated file are read by the ``LAYERED`` backends (magicpig, magicpig-ref, hybrid)."""
    from magicpig_jax.models.backends import LAYERED

    attention = set(args.attention)
    lsh_backends = attention & set(LAYERED)
    sparse = attention - {"dense"}
    layered = args.magicpig_config is not None
    if "heavy" in given and "hybrid" not in attention:
        raise ValueError("--heavy applies to attention hybrid, which is not in --attention")
    lsh_flags = [f"--{n.replace('_', '-')}" for n in ("K", "L", "layers_per_projection", "heavy") if n in given]
    if lsh_flags and not lsh_backends:
        raise ValueError(f"{lsh_flags[0]} applies to attention magicpig, magicpig-ref and hybrid, none of which is "
                         "in --attention")
    if lsh_flags and layered:
        raise ValueError(f"{lsh_flags[0]} cannot be combined with --magicpig-config (the file gives each layer's "
                         "settings)")
    static_flags = [f"--{n.replace('_', '-')}" for n in ("num_sink", "num_local", "dense_layers") if n in given]
    if static_flags and not sparse:
        raise ValueError(f"{static_flags[0]} applies to the sparse backends only; --attention lists dense alone")
    static_flags = [f for f in static_flags if f != "--dense-layers"]  # refused with the file in _layer_configs
    if static_flags and layered and not sparse - lsh_backends:
        raise ValueError(f"{static_flags[0]} cannot be combined with --magicpig-config (the file gives each layer's "
                         "settings)")
    if args.temperature == 0 and args.top_p != 1.0:
        raise ValueError("--top-p applies to sampling only; with --temperature 0 decoding is greedy")
    seeded = "oracle" in attention or args.temperature != 0 or (lsh_backends and not layered)
    if "seed" in given and not seeded:
        raise ValueError("--seed has no effect here: decoding is greedy (--temperature 0) and no backend in "
                         "--attention draws from it (magicpig, magicpig-ref and hybrid without --magicpig-config, "
                         "oracle)")


def _check_model(args, layered=None) -> None:
    """``--model``'s metadata (no weights): a path that is no model fails here, before the command
    prints anything; ``--dense-layers`` and ``--magicpig-config`` against its layer count, and the
    file's K against the host index when ``magicpig`` runs it."""
    from magicpig_jax import lsh
    from magicpig_jax.host.index import HOST_MAX_K, HOST_MAX_L
    from magicpig_jax.io.loader import read_model_config

    config = read_model_config(args.model)
    n = config.num_layers
    if layered is not None:
        try:
            layered.check_model(config.model_shape())
        except ValueError as err:
            raise ValueError(f"--magicpig-config {args.magicpig_config}: {err}") from None
        sparse = [(i, c) for i, c in layered.layers if c != "dense"]
        heavy = [i for i, c in sparse if getattr(c, "heavy", None) is not None]
        ignoring = [name for name in ("magicpig", "magicpig-ref") if name in args.attention]
        if heavy and ignoring:
            raise ValueError(f"--magicpig-config {args.magicpig_config}: layer {heavy[0]} gives a heavy threshold, "
                             f"which only attention 'hybrid' reads; '{ignoring[0]}' would ignore it")
        light = [i for i, c in sparse if getattr(c, "heavy", None) is None]
        if light and "hybrid" in args.attention:
            raise ValueError(f"--magicpig-config {args.magicpig_config}: attention 'hybrid' needs a heavy threshold "
                             f"in every sparse layer; layer {light[0]} gives none")
        too_big = [(i, "K", c.K, HOST_MAX_K) for i, c in sparse if c.K > HOST_MAX_K] + [
            (i, "L", c.L, HOST_MAX_L) for i, c in sparse if c.L > HOST_MAX_L]
        from magicpig_jax.models.backends.spec import host_ops_by_default

        # (on an accelerator per-layer configs run in pure JAX: DecodeSpec's choice)
        if too_big and "magicpig" in args.attention and host_ops_by_default():
            i, name, value, most = too_big[0]
            pure = f"'magicpig-ref' (pure JAX) up to {lsh.MAX_K if name == 'K' else lsh.MAX_L}"
            raise ValueError(f"--magicpig-config {args.magicpig_config}: layer {i} has {name} = {value}; attention "
                             f"'magicpig' (the host index) takes {name} in [{1 if name == 'K' else 2}, {most}], {pure}")
    bad = [i for i in args.dense_layers or () if i >= n]
    if bad:
        raise ValueError(f"--dense-layers {','.join(map(str, bad))} out of range: the model has {n} layers "
                         f"(indices 0..{n - 1})")


def _layer_configs(args):
    """The per-layer configs of ``--magicpig-config`` (None without it)."""
    if args.magicpig_config is None:
        return None
    from magicpig_jax.attention import LayerConfigs

    if args.dense_layers is not None:
        raise ValueError("--dense-layers cannot be combined with --magicpig-config (the file names the dense layers)")
    from magicpig_jax.eval.calibrate import recorded_identities

    configs = LayerConfigs.load(args.magicpig_config)
    recorded_identities(args.magicpig_config)  # its model identities' types: before the model loads
    return configs


def _runs_on(spec) -> str:
    """Which implementation runs a spec, and on which JAX backend ("magicpig (host op), CPU")."""
    import jax

    from magicpig_jax.models.backends import backend_for

    name = backend_for(spec).name
    return f"{name}, {jax.default_backend().upper()}"


def _where(spec, prompt_tokens: int, num_layers: int) -> str:
    """Which attention runs where, and a note when the layers or the prompt leave nothing to sample."""
    where = _runs_on(spec)
    cfg = spec.magicpig
    if spec.backend != "dense" and not spec.sparse_layers(num_layers):
        dense = tuple(range(num_layers))
        how = ("the --magicpig-config file keeps every layer dense" if spec.layers is not None
               else "choose the dense layers with --dense-layers")
        where += (f"; note: every layer of this {num_layers}-layer model is dense (dense layers {dense}), so the "
                  f"result equals dense attention: {how}")
    elif spec.backend != "dense" and prompt_tokens <= cfg.num_sink + cfg.num_local:
        where += (f"; note: the prompt ({prompt_tokens} tokens) is no longer than num_sink + num_local = "
                  f"{cfg.num_sink + cfg.num_local}, so every key is static and the result equals dense attention")
    return where


def _stream_answer(model, state, spec, max_new_tokens: int, sampling, stops, consume: bool) -> dict:
    """Decode with ``spec``, printing the answer as it is produced; the stats with the text.

    The CLI runs each backend once, so the programs of its index build and of its decode step
    are freed as soon as they are done (:func:`~magicpig_jax.memory.drop_compiled_programs`):
    the peak then holds one backend's compiled step, not every phase's.
    """
    from magicpig_jax.decode_loop import start_decode
    from magicpig_jax.memory import drop_compiled_programs
    from magicpig_jax.streaming import StopStrings, TextStream

    criterion = StopStrings(model.tokenizer.decode, stops) if stops else None
    run = start_decode(model, state, spec, max_new_tokens, sampling, stop=criterion, consume_prefill=consume)
    drop_compiled_programs()  # the index build's program (and the cache copy's)
    text = TextStream(model.tokenizer.decode, stops, getattr(model.tokenizer, "partial_token", None))
    where = _where(spec, int(state.prompt_lengths[0]), model.config.num_layers)
    print(f"\n=== answer with {spec.backend} attention ({where}) ===", flush=True)
    for outputs in run:
        print(text.push(outputs[0]), end="", flush=True)
    print(text.push(run.outputs[0], final=True), flush=True)
    if run.stop_reasons[0] == "context":
        print(f"(stopped after {len(run.outputs[0])} tokens: the model's context of {run.max_positions} positions "
              "is full)", flush=True)
    stats = run.stats()
    full = model.tokenizer.decode(run.outputs[0])
    stats["text"] = criterion.cut(full) if criterion else full
    stats["token_ids"] = run.outputs[0]
    stats["stop"] = list(stops)
    del run
    drop_compiled_programs()  # this backend's decode step
    return stats


def _summary(results: dict, prompt_tokens: int, prefill_seconds: float) -> str:
    import textwrap

    w = max(len("attention"), *map(len, results))  # the first column fits the longest backend name
    lines = ["", "=== summary ===", f"prompt tokens: {prompt_tokens}    prefill: {prefill_seconds:.2f} s",
             f"{'attention':<{w}}  {'decode tok/s':>12}  {'steps':>5}  {'compile s':>9}  {'sampled/selected':>17}"]
    for name, r in results.items():
        frac = "-" if r["sampled_fraction"] is None else f"{100 * r['sampled_fraction']:.2f}%"
        rate = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.2f}"
        lines.append(f"{name:<{w}}  {rate:>12}  {r['decode_steps']:>5}  {r['compile_seconds']:>9.1f}  {frac:>17}")
    for name, r in results.items():
        per = r["sampled_fraction_per_layer"]
        if per:
            dense = ",".join(map(str, r["dense_layers"])) or "none"
            chosen = "selected" if name in ("topk", "quest") else "sampled"  # TopK and Quest select, the rest sample
            lines.append(f"{name}: % of the context's keys {chosen} per decode step beside the sinks and local "
                         f"window, layer:% (dense layers {dense})")
            cells = " ".join(f"{layer}:{100 * f:.1f}" for layer, f in per.items())
            lines.extend(textwrap.wrap(cells, 96, initial_indent="  ", subsequent_indent="  "))
    return "\n".join(lines)


def _add_convert(sub) -> None:
    p = sub.add_parser("convert",
                       description="Write a model as an orbax checkpoint (quantized matrices as their GGUF rows).")
    p.add_argument("model", help="GGUF file or Hugging Face directory ('embedded' = the bundled SmolLM2)")
    p.add_argument("out", type=path_arg, help="checkpoint directory to create")
    p.set_defaults(func=_cmd_convert)


def _cmd_convert(args) -> int:
    import time

    from magicpig_jax.io.loader import convert_model

    if not args.model.strip():
        raise ValueError("convert: MODEL is empty (the first argument: a .gguf file, a Hugging Face directory, "
                         "or 'embedded')")
    if args.model != "embedded" and not Path(args.model).exists():
        raise FileNotFoundError(f"convert: model {args.model} does not exist (the first argument: a .gguf file, "
                                "a Hugging Face directory, or 'embedded')")
    from magicpig_jax.io.checkpoint import is_checkpoint, leftover_partials

    if args.out.is_dir() and is_checkpoint(args.out):
        raise FileExistsError(f"{args.out} already holds a checkpoint; choose another OUT or remove it")
    left = leftover_partials(args.out)
    inside = [p.name for p in left if p.parent == args.out.absolute()]
    if inside:
        raise FileExistsError(f"OUT {args.out} holds {inside[0]}, from an interrupted conversion (or one running "
                              "now): remove it, or give a new or empty OUT")
    check_output("OUT", args.out, "new-dir")
    start = time.perf_counter()
    out = convert_model(None if args.model == "embedded" else args.model, args.out)
    # convert_model loaded what it wrote before keeping it: no second load here
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s (loaded back before it was kept; use it with "
          f"--model {out})")
    for p in left:  # beside OUT: not in the way, but maybe the size of a model
        print(f"magicpig-jax: note: convert: {p} is from an interrupted conversion to {args.out} (or one running "
              "now): remove it when no conversion runs", file=sys.stderr)
    return 0


def _add_delegate(sub, name: str, help_text: str, targets: dict[str, str]) -> None:
    p = sub.add_parser(name, description=help_text,
                       epilog=f"`magicpig-jax {name} WHAT --help` shows the options of WHAT.")
    p.add_argument("what", metavar="WHAT", choices=sorted(targets), help=f"what to run: {', '.join(sorted(targets))}")
    p.add_argument("rest", metavar="OPTIONS", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # WHAT's options
    p.set_defaults(func=lambda a: _delegate(targets[a.what], a.rest))


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return int(importlib.import_module(module).main(argv) or 0)


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of ``magicpig-jax``."""
    parser = Parser(prog="magicpig-jax", description=__doc__)
    # The description lists the subcommands (with bench's and study's WHAT): no second list.
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the subcommands above; `magicpig-jax COMMAND --help` shows its options")
    _add_generate(sub)
    _add_convert(sub)
    _add_delegate(sub, "bench", "benchmarks (JSON + PNG)", {"attention": "magicpig_jax.eval.bench_attention",
                                                          "decode": "magicpig_jax.eval.bench_decode"})
    _add_delegate(sub, "study", "estimator studies (JSON + PNG)", {"attention": "magicpig_jax.eval.study"})
    ev = sub.add_parser("eval", add_help=False, prefix_chars="\0")  # every argument goes to magicpig_jax.eval.run
    ev.add_argument("rest", nargs=argparse.REMAINDER)
    ev.set_defaults(func=lambda a: _delegate("magicpig_jax.eval.run", a.rest))
    cal = sub.add_parser("calibrate", add_help=False, prefix_chars="\0")  # arguments: magicpig_jax.eval.calibrate
    cal.add_argument("rest", nargs=argparse.REMAINDER)
    cal.set_defaults(func=lambda a: _delegate("magicpig_jax.eval.calibrate", a.rest))
    return parser


class _Sigint:
    """Ctrl-C raises KeyboardInterrupt, is remembered, and is delivered again until the command ends.

    Python drops an exception raised inside a garbage-collector callback (it only prints
    "Exception ignored in ..."), so an interrupt that lands there is lost, and one that lands
    inside JAX's C++ tracing can come back as another exception (a ValueError holding the
    KeyboardInterrupt's traceback): both were seen under load. So after a Ctrl-C the signal is
    sent again every half second while the command runs, and any error is reported as the
    interruption it is (exit 130), never as bad input (exit 2).
    """

    seen = False
    active = False
    resend: threading.Thread | None = None

    @classmethod
    def handler(cls, signum, frame):
        if not cls.active:  # the command has ended: a late re-delivery is ignored
            return
        cls.seen = True
        if cls.resend is None:
            main_id = threading.main_thread().ident
            cls.resend = threading.Thread(target=cls._resend, args=(main_id,), daemon=True)
            cls.resend.start()
        if cls._dropped_in(frame):  # raised here it would only be printed: the next re-delivery raises
            return
        raise KeyboardInterrupt

    @staticmethod
    def _dropped_in(frame) -> bool:
        """Whether Python drops an exception raised in ``frame``: a garbage-collector callback
        (JAX registers one) or a ``__del__``."""
        if frame is None:
            return False
        code = frame.f_code
        return code.co_name == "__del__" or any(getattr(cb, "__code__", None) is code for cb in gc.callbacks)

    @classmethod
    def _resend(cls, main_id: int) -> None:
        while True:
            time.sleep(0.5)
            if not cls.active:
                return
            signal.pthread_kill(main_id, signal.SIGINT)


def _interrupted() -> int:
    print("\nmagicpig-jax: interrupted", file=sys.stderr)
    return 130


def _command(args) -> str:
    """The subcommand as typed: ``generate``, ``bench decode``, ..."""
    return " ".join([args.command] + ([args.what] if getattr(args, "what", None) else []))


def _error_line(command: str, message: str) -> str:
    """One error line as the parser writes it: ``magicpig-jax: error: COMMAND: message``, with
    ``(see --help)`` when it gives a flag's allowed values (``--top-p must be in (0, 1], ...``)."""
    where = "" if message.startswith(f"{command}:") else f"{command}: "
    hint = " (see --help)" if re.match(r"--[\w-]+ must ", message) else ""
    return f"magicpig-jax: error: {where}{message}{hint}"


def _unrecognized(parser: argparse.ArgumentParser, argv: list[str], extra: list[str]) -> None:
    """Exit 2 with one line naming the command whose arguments ``extra`` are not, and the option a
    misspelled flag may have meant (``--promt``: ``--prompt``)."""
    from magicpig_jax.argparsing import unrecognized_arguments

    command = parser
    for token in argv:  # the subcommand (and its own subcommand) the arguments went to
        sub = next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and token in sub.choices:
            command = sub.choices[token]
    command.error(unrecognized_arguments(command, extra))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``magicpig-jax``; returns the exit status (2 on bad input, with the reason;
    130 after Ctrl-C)."""
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command that was given, with the flag it may have meant
        _unrecognized(parser, sys.argv[1:] if argv is None else list(argv), extra)
    # Only where Python's own handler is installed (not when SIGINT is ignored, as for a
    # background job), and only from the main thread (signal.signal's rule).
    ours = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _Sigint.seen, _Sigint.resend = False, None
    if ours:
        _Sigint.active = True
        signal.signal(signal.SIGINT, _Sigint.handler)
    try:
        try:
            status = args.func(args)
        finally:
            _Sigint.active = False  # from here on a re-delivered Ctrl-C raises nothing
        return _interrupted() if _Sigint.seen else status
    except KeyboardInterrupt:
        return _interrupted()
    except (ValueError, TypeError, OSError) as err:  # OSError: FileNotFoundError, a name too long, a directory...
        if _Sigint.seen:
            return _interrupted()
        print(_error_line(_command(args), str(err)), file=sys.stderr)
        return 2
    except FloatingPointError as err:  # NaN logits: the model or its cache holds a non-finite value
        if _Sigint.seen:
            return _interrupted()
        print(_error_line(_command(args), str(err)), file=sys.stderr)
        return 1
    except Exception:
        if _Sigint.seen:
            return _interrupted()
        raise
    finally:
        if ours:
            if _Sigint.resend is not None:
                _Sigint.resend.join()
                time.sleep(0.05)  # a re-delivery still in flight meets the inactive handler
            signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
