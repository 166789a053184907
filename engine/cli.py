"""`omlx`: the command line. Output formats here are a contract (external checks call them):
`tokenize` prints a JSON list, `generate --json` one JSON object, `logprobs` writes the
reference .npz format, `models fetch` prints the model's path as its last stdout line (also for
`hf:OWNER/REPO/FILE.gguf`; `hf:OWNER/REPO` alone lists the repo's GGUF files instead).
Progress and logs go to stderr. Commands that load a model first estimate its memory
(engine.fit) and refuse one that does not fit unless given --force."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

from . import catalog, fit, hub
from .errors import OmlxError, describe
from .gguf_file import GGUFFile
from .kv.config import PRESETS, KVConfig, KVConfigError, estimate_bytes, parse_kv
from .sampling import SamplingParams
from .speculate import SPECULATE_MODES
from .tokenizer import Tokenizer

log = logging.getLogger("omlx")


class CLIError(Exception):
    pass


def _progress_printer(stream=sys.stderr):
    """progress(stage, fraction) → stderr: a live line on a terminal; in a log, one line per
    stage and per quarter."""
    last = {"stage": None, "pct": -1}
    live = stream.isatty()

    def report(stage: str, fraction: float) -> None:
        pct = int(fraction * 100)
        new_stage = stage != last["stage"]
        if not new_stage and (pct == last["pct"] or (not live and pct // 25 == last["pct"] // 25)):
            return
        last.update(stage=stage, pct=pct)
        if live:
            stream.write(("\n" if new_stage and last["stage"] else "") + f"\r{stage}: {pct:3d}%")
        else:
            stream.write(f"{stage}: {pct}%\n")
        stream.flush()

    return report


def _end_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\n")


def _resolve(spec: str) -> Path:
    return catalog.resolve_model(spec, fetch_missing=False)


def _fit_ctx(args) -> int | None:
    """The context the fit check assumes: --ctx where the command has it, else the tokens this
    run can reach (generate: prompt bytes, an upper bound on its tokens, plus --max-tokens;
    logprobs and eval-kv: --n-tokens + 1), else None (the model's whole context)."""
    if getattr(args, "ctx", None):
        return args.ctx
    if getattr(args, "prompt", None) is not None and getattr(args, "max_tokens", None) is not None:
        return len(args.prompt.encode("utf-8")) + args.max_tokens + 16  # + chat template tokens
    if getattr(args, "n_tokens", None) is not None:
        return args.n_tokens + 1
    return None


def _draft_path(args) -> Path | None:
    """--draft MODEL's file, where the command has it and it is given."""
    return _resolve(args.draft) if getattr(args, "draft", None) else None


def _check_fit(path: Path, args, kv=None) -> None:
    """Refuse (DoesNotFit) a model, with its --draft model if given, whose estimated memory
    exceeds what is available, unless --force."""
    est = fit.check_fits(path, _fit_ctx(args), args.kv if kv is None else kv, force=args.force,
                         draft=_draft_path(args))
    log.debug("memory estimate: %s", est.summary())
    if est.verdict != fit.FITS:
        log.warning("%s", est.summary())


def _load_engine(args):
    from .engine import Engine

    path = _resolve(args.model)
    _check_fit(path, args)
    engine = Engine.load(path, kv=args.kv)
    engine.speculate = getattr(args, "speculate", engine.speculate)
    _use_draft(engine, args)
    return engine


def _use_draft(engine, args) -> None:
    """--draft MODEL: loaded, its vocabulary checked (a SettingsError before any work), drafting
    for `engine` instead of --speculate."""
    from .speculate import load_draft

    if getattr(args, "draft", None):
        engine.set_draft(load_draft(engine, _resolve(args.draft)))
        if engine.speculate != "off":
            log.warning("--draft %s drafts; --speculate %s is not used", args.draft, engine.speculate)


def _sampling(args) -> SamplingParams:
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )
    params.validate()
    return params


# -- commands ----------------------------------------------------------------------------------
def cmd_models(args) -> int:
    if args.models_cmd == "list":
        for entry in catalog.CATALOG.values():
            state = "fetched" if catalog.is_fetched(entry.name) else "not fetched"
            default = " (default)" if entry.name == catalog.DEFAULT_MODEL else ""
            print(f"{entry.name:24s} {entry.size / 2**20:7.1f} MiB  {state:11s}  {entry.description}{default}")
        listed = set()
        for entry in catalog.HUB_CATALOG.values():
            path = catalog.hub_entry_path(entry.name)
            state = "fetched" if path is not None else "not fetched"
            listed.add(path)
            print(f"{entry.name:24s} {entry.size / 2**20:7.1f} MiB  {state:11s}  {entry.description} "
                  f"(Hugging Face: {entry.spec})")
        for model in hub.downloaded_models():
            if model.path not in listed:
                print(f"{model.spec:24s} {model.size / 2**20:7.1f} MiB  {'fetched':11s}  "
                      f"downloaded from Hugging Face ({model.where}: {model.path})")
        return 0
    if args.models_cmd == "path":
        if args.name in catalog.HUB_CATALOG or hub.is_hub_spec(args.name):
            entry = catalog.HUB_CATALOG.get(args.name)
            repo, filename = hub.parse_spec(entry.spec if entry else args.name)
            if filename is None:
                raise CLIError(f"'{args.name}' names a repo; give hf:{repo}/FILE.gguf")
            print(hub.find_downloaded(repo, filename) or hub.local_path(repo, hub.HubFile(
                repo, filename, (), hub.quant_type(filename))))
            return 0
        print(catalog.model_path(args.name))
        return 0
    if args.models_cmd == "fetch":
        names = list(catalog.CATALOG) if args.all else [args.name or catalog.DEFAULT_MODEL]
        for name in names:
            if name in catalog.HUB_CATALOG:
                name = catalog.HUB_CATALOG[name].spec
            if hub.is_hub_spec(name):
                repo, filename = hub.parse_spec(name)
                if filename is None:
                    _print_listing(hub.list_files(repo))
                    continue
                path = hub.download(repo, filename, progress=_progress_printer(), force=args.force)
            else:
                path = catalog.fetch(name, progress=_progress_printer(), force=args.force)
            _end_progress()
            print(path)
        return 0
    raise CLIError("usage: omlx models {list,fetch,path}")


def _print_listing(listing) -> None:
    """A repo's GGUF files: name, size, quant type, a fit verdict from the size, the spec to fetch."""
    available = fit.available_bytes()
    print(f"{listing.repo}: {len(listing.files)} GGUF file{'s' if len(listing.files) != 1 else ''} "
          f"({_fmt_bytes(available)} of memory available)")
    width = max(len(f.name) for f in listing.files)
    for f in listing.files:
        parts = f" in {len(f.parts)} parts" if len(f.parts) > 1 else ""
        print(f"  {f.name:{width}s}  {_fmt_bytes(f.size):>11s}  {f.quant:8s} "
              f"{fit.download_verdict(f.size, available):12s}{parts}")
    print(f"download one with: omlx models fetch hf:{listing.repo}/FILE.gguf")


def cmd_tokenize(args) -> int:
    parse_kv(args.kv)  # accepted everywhere; tokenizing uses no cache, but a bad spec still fails
    tokenizer = Tokenizer.from_metadata(GGUFFile(_resolve(args.model)).metadata)
    ids = tokenizer.encode(args.text, add_bos=args.bos, parse_special=args.special)
    print(json.dumps(ids))
    return 0


def cmd_info(args) -> int:
    from collections import Counter

    from .models import model_args
    from .weights import weight_kernels

    gguf = GGUFFile(_resolve(args.model))
    model = model_args(gguf)  # metadata only: printing sizes needs no weights
    tokenizer = Tokenizer.from_metadata(gguf.metadata)
    config = parse_kv(args.kv)
    estimate = fit.estimate(gguf, args.ctx, config)
    g = model.kv_geometry()
    kv_ctx = estimate_bytes(config, g.n_layers, g.n_kv_heads, g.head_dim, g.context_length,
                            g.value_dim, windows=list(g.windows))["total"]
    types = Counter(t.type_name for t in gguf.tensors.values())
    n_params = sum(int(__import__("numpy").prod(t.shape)) for t in gguf.tensors.values())
    info = {
        "name": gguf.get("general.name"),
        "file": str(gguf.path),
        "file_bytes": gguf.file_size,
        "architecture": gguf.architecture,
        "parameters": n_params,
        "layers": model.n_layers,
        "embedding_dim": model.dim,
        "heads": model.n_heads,
        "kv_heads": model.n_kv_heads,
        "head_dim": model.head_dim,
        "context_length": model.context_length,
        "vocab_size": model.vocab_size,
        "tensor_types": dict(types.most_common()),
        "chat_template": tokenizer.chat_template is not None,
        "kv_bytes_per_token_f16": g.bytes_per_token(),
        "kv_spec": str(config),
        "kv_bytes_at_full_context": kv_ctx,
        "fit": estimate.as_dict(),
        "weight_kernels": weight_kernels(gguf),
    }
    draft_gguf = GGUFFile(_resolve(args.draft)) if args.draft else None
    if draft_gguf is not None:
        info["draft"] = _info_draft(gguf, model, tokenizer, draft_gguf, args.ctx, config,
                                    estimate.available_bytes)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['name']}  ({info['file']}, {info['file_bytes'] / 2**20:.1f} MiB)")
    print(f"  architecture   {info['architecture']}, {n_params / 1e6:.1f}M parameters")
    print(f"  layers         {model.n_layers} × dim {model.dim}; {model.n_heads} query heads, "
          f"{model.n_kv_heads} KV heads × {model.head_dim}")
    print(f"  context        {model.context_length:,} tokens; vocabulary {model.vocab_size:,}")
    print("  tensor types   " + ", ".join(f"{k} ×{v}" for k, v in types.most_common()))
    print(f"  chat template  {'yes' if info['chat_template'] else 'no (plain completion)'}")
    wk = info["weight_kernels"]
    on_int = f"; on them: {', '.join(wk['int'])}" if wk["int"] else ""
    on_float = f"; float kernels: {', '.join(wk['float'])}" if wk["float"] and wk["int"] else ""
    print(f"  weight kernels {wk['kernels']}{on_int}{on_float}")
    kv = g.bytes_per_token()
    print(f"  KV cache       {kv / 1024:.1f} KiB/token at 16 bits "
          f"({kv * model.context_length / 2**20:,.0f} MiB at the full context); "
          f"{config}: {_fmt_bytes(kv_ctx)} at the full context")
    print(f"  will it fit    {estimate.summary()}")
    if draft_gguf is not None:
        d = info["draft"]
        can = ("can draft for it (the same vocabulary)" if d["can_draft"]
               else f"cannot draft for it: {d['reason']}")
        print(f"  draft model    {d['name']} ({d['file']}, {d['file_bytes'] / 2**20:.1f} MiB): {can}")
        if d["fit"] is not None:
            print(f"  with the draft {d['fit']['summary']}")
    return 0


def _info_draft(gguf, model, tokenizer, draft, ctx, config, available: int) -> dict:
    """`info --draft`: whether the open GGUFFile `draft` can draft for `gguf` (speculate's
    check, from the headers) and the pair's memory estimate (None if the draft model cannot be
    read as a model)."""
    from .models import model_args
    from .speculate import check_vocabulary

    name = str(draft.get("general.name") or draft.path.stem)
    out = {"name": name, "file": str(draft.path), "file_bytes": draft.file_size,
           "can_draft": False, "reason": None, "fit": None}
    try:
        draft_model = model_args(draft)
        check_vocabulary(str(gguf.get("general.name") or gguf.path.stem), model.vocab_size, tokenizer,
                         name, draft_model.vocab_size, Tokenizer.from_metadata(draft.metadata))
        out["can_draft"] = True
    except OmlxError as exc:
        out["reason"] = exc.user_message
    try:
        pair = fit.estimate(gguf, ctx, config, available, draft=draft)
        out["fit"] = {**pair.as_dict(), "summary": pair.summary()}
    except OmlxError as exc:  # not a model this engine runs
        out["reason"] = out["reason"] or exc.user_message
    return out


def cmd_generate(args) -> int:
    from .engine import EngineError

    engine = _load_engine(args)
    if args.chat:
        if not engine.has_chat_template:
            raise EngineError(f"{engine.name} has no chat template; drop --chat for plain completion")
        prompt_ids = engine.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = engine.encode_prompt(args.prompt)
    processors = ()
    if args.json_schema:
        from .constrain import JsonConstraint

        try:
            schema = Path(args.json_schema).read_text(encoding="utf-8")
        except OSError as exc:
            raise EngineError(f"cannot read --json-schema {args.json_schema}: {exc.strerror}") from None
        processors = (JsonConstraint(engine.tokenizer, schema, len(prompt_ids)),)
    gen = engine.stream(prompt_ids, max_tokens=args.max_tokens, sampling=_sampling(args), stop=args.stop or (),
                        processors=processors)
    for chunk in gen:
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    result = gen.result
    if args.json:
        print(json.dumps({
            "ids": result.ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "stats": result.stats.as_dict(),
        }, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        s = result.stats
        log.info("%d prompt tokens, TTFT %.2f s, %.1f tok/s decode, peak RSS %.0f MiB, KV %.1f MiB (%s)",
                 s.prompt_tokens, s.ttft_s, s.decode_tok_s, s.peak_rss_bytes / 2**20, s.kv_bytes / 2**20,
                 result.finish_reason)
    return 0


def cmd_logprobs(args) -> int:
    from .engine import EngineError

    engine = _load_engine(args)
    text = Path(args.text_file).read_text(encoding="utf-8")
    ids = engine.tokenizer.encode(text, add_bos=True, parse_special=False)
    if len(ids) < args.n_tokens + 1:
        raise EngineError(f"{args.text_file} has {len(ids):,} tokens, fewer than --n-tokens + 1 = {args.n_tokens + 1:,}")
    report = _progress_printer()
    result = engine.teacher_forced(ids[: args.n_tokens + 1], progress=lambda d, n: report("evaluating", d / n))
    _end_progress()
    result.save(args.out)
    print(args.out)
    return 0


def _session(args):
    """Engine + Session with the documents of --doc pinned (prefilled with progress)."""
    from .session import Session

    if not args.ctx:  # the model's context, capped by what fits in memory at the KV setting
        args.ctx = fit.default_context_file(_resolve(args.model), args.kv, draft=_draft_path(args))
    engine = _load_engine(args)
    session = Session(engine, system_prompt=getattr(args, "system", None), ctx=args.ctx,
                      overflow=args.overflow, doc_mode=args.doc_mode,
                      retrieval_tokens=args.retrieval_tokens)
    for path in args.doc or []:
        doc = session.add_document(path, prefill=args.prefill_docs, progress=_indexing(path))
        how = "whole" if doc.mode == "whole" else f"by retrieval, {len(doc.index.chunks):,} sections"
        print(f"pinned {doc.name}: {doc.n_tokens:,} tokens ({how})", file=sys.stderr)
    return engine, session


def _indexing(path):
    """For a file indexed from the file (over documents.STREAM_BYTES: minutes for hundreds of
    MB), a progress callback printing every tenth on stderr; else None."""
    from . import documents

    try:
        if Path(path).stat().st_size <= documents.STREAM_BYTES:
            return None
    except OSError:
        return None
    shown = [0]

    def progress(done: int, total: int) -> None:
        tenth = 10 * done // max(total, 1)
        if total > 1 and shown[0] < tenth < 10:
            shown[0] = tenth
            print(f"indexing {Path(path).name}: {10 * tenth}%", file=sys.stderr, flush=True)
    return progress


def _stats_line(s) -> str:
    parts = [f"{s.generated_tokens} tokens", f"TTFT {s.ttft_s:.2f} s", f"{s.decode_tok_s:.1f} tok/s",
             f"{s.cached_tokens:,}/{s.prompt_tokens:,} prompt tokens cached ({s.cache_source})"]
    if s.dropped_tokens:
        parts.append(f"{s.dropped_tokens:,} dropped at the context limit")
    return "[" + ", ".join(parts) + "]"


def _sections_line(retrieved: list[dict]) -> str:
    if not retrieved:
        return "[no sections retrieved]"
    return "[sections: " + "; ".join(f"{r['document']} {r['label']}" for r in retrieved) + "]"


def cmd_chat(args) -> int:
    args.prefill_docs = True
    engine, session = _session(args)
    sampling = _sampling(args)
    mode = "chat" if engine.has_chat_template else "completion"
    print(f"{engine.name} ({mode}, context {session.ctx:,}, overflow {session.overflow}). "
          "Empty line or /quit to leave, /reset to start over.", file=sys.stderr)
    retrieval_docs = any(d.mode == "retrieval" for d in session.documents if d.pinned)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("", "/quit", "/exit"):
            return 0
        if line.strip() == "/reset":
            session.reset()
            continue
        gen = session.send(line, max_tokens=args.max_tokens, sampling=sampling)
        try:
            for chunk in gen:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        result = gen.result
        sys.stdout.write("\n")
        if retrieval_docs:
            print(_sections_line(gen.retrieved), file=sys.stderr)
        print(_stats_line(result.stats), file=sys.stderr)


def cmd_ask(args) -> int:
    """Questions in turn about pinned documents, each answered on its own (not a conversation);
    the document is prefilled by the first question, so its TTFT is the cold one."""
    args.prefill_docs = False
    engine, session = _session(args)
    sampling = _sampling(args)
    questions = list(args.question or [])
    if args.questions_file:
        questions += [q.strip() for q in Path(args.questions_file).read_text().splitlines() if q.strip()]
    if not questions:
        raise CLIError("give at least one --question (or --questions-file)")
    answers = []
    for q in questions:
        gen = session.ask(q, max_tokens=args.max_tokens, sampling=sampling)
        result = gen.result
        s = result.stats
        answers.append({"question": q, "text": result.text, "ids": result.ids,
                        "finish_reason": result.finish_reason, "stats": s.as_dict(),
                        "retrieved": gen.retrieved})
        if not args.json:
            print(f"Q: {q}\nA: {result.text.strip()}")
            if gen.retrieved:
                print(_sections_line(gen.retrieved), file=sys.stderr)
            print(_stats_line(s), file=sys.stderr)
    if args.json:
        docs = [{"name": d.name, "tokens": d.n_tokens, "cached": d.cached, "mode": d.mode}
                for d in session.documents]
        print(json.dumps({"model": engine.name, "kv": str(engine.kv_config), "ctx": session.ctx,
                          "overflow": session.overflow, "doc_mode": session.doc_mode,
                          "documents": docs, "answers": answers}))
    return 0


def cmd_bench(args) -> int:
    from . import bench
    from .engine import Engine

    if not args.qa:
        alone = next((flag for flag, given in (("--qa-facts", args.qa_facts), ("--qa-filler", args.qa_filler),
                                               ("--qa-sizes", args.qa_sizes)) if given), None)
        if alone:
            raise CLIError(f"{alone} goes with --qa")
    path = _resolve(args.model)
    if args.qa:
        return _bench_qa(args, path)
    _check_fit(path, args, kv=(args.kv or ["full"])[0])
    engine = Engine.load(path)
    doc = Path(args.doc) if args.doc else bench.DEFAULT_DOC
    questions = bench.read_questions(Path(args.questions) if args.questions else bench.DEFAULT_QUESTIONS)
    if not questions:
        raise CLIError("the questions file has no questions")
    specs = [str(parse_kv(s)) for s in (args.kv or ["full", "k8v8", "k6v4", "k4v4"])]
    results = bench.run_bench(engine, specs, doc=doc, questions=questions, max_tokens=args.max_tokens,
                              ctx=args.ctx, kl_tokens=args.kl_tokens,
                              progress=lambda msg: print(msg, file=sys.stderr), tuned=args.tuned)
    row = bench.llama_cpp_row(engine.path, doc.read_text(), questions[0], args.max_tokens)
    paths = bench.write_report(results, Path(args.out), model=engine.name, doc=doc,
                               n_questions=len(questions), llama_cpp=row)
    print(paths["markdown"].read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path}", file=sys.stderr)
    return 0


def _bench_qa(args, path: Path) -> int:
    from . import bench
    from .engine import Engine

    args.ctx = args.ctx or bench.QA_CTX
    specs = [str(parse_kv(s)) for s in (args.kv or ["k8v8", "k6v4", "k4v4"])]
    facts_path = Path(args.qa_facts) if args.qa_facts else bench.QA_FACTS
    if not facts_path.is_file():
        raise CLIError(f"--qa-facts: no file {facts_path}")
    try:
        facts = bench.read_facts(facts_path)
    except ValueError as exc:
        raise CLIError(f"--qa-facts: {exc}") from None
    filler = [Path(f) for f in args.qa_filler] if args.qa_filler else facts["filler"]
    missing = [str(f) for f in filler if not f.is_file()]
    if missing:
        raise CLIError(f"{'--qa-filler' if args.qa_filler else facts_path}: no file {', '.join(missing)}")
    _check_fit(path, args, kv=specs[0])
    engine = Engine.load(path)
    sizes = bench.QA_SIZES
    if args.qa_sizes:
        try:
            sizes = tuple(x.strip() if x.strip() == "ctx" else float(x) for x in args.qa_sizes.split(","))
        except ValueError:
            raise CLIError(f"--qa-sizes takes numbers (or ctx) separated by commas, e.g. ctx,4,16; "
                           f"not {args.qa_sizes!r}") from None
    rows = bench.run_qa(engine, specs, ctx=args.ctx, sizes=sizes, max_tokens=args.max_tokens,
                        facts_path=facts_path, filler=filler,
                        retrieval_tokens=args.retrieval_tokens, retrieval_min_ratio=args.retrieval_min_ratio,
                        progress=lambda msg: print(msg, file=sys.stderr))
    paths = bench.write_qa_report(rows, Path(args.out), model=engine.name, ctx=args.ctx,
                                  facts_path=facts_path, filler=filler)
    print(paths["markdown"].read_text())
    for kind, p in paths.items():
        print(f"{kind}: {p}", file=sys.stderr)
    return 0


def _geometry(args):
    """KVGeometry from a model's metadata or from --layers/--kv-heads/--head-dim."""
    from .models import kv_geometry
    from .models.base import KVGeometry

    if args.model:
        return kv_geometry(GGUFFile(_resolve(args.model)))
    missing = [f"--{n}" for n in ("layers", "kv-heads", "head-dim") if getattr(args, n.replace("-", "_")) is None]
    if missing:
        raise CLIError(f"give a model, or all of --layers, --kv-heads, --head-dim (missing: {', '.join(missing)})")
    return KVGeometry(args.layers, args.kv_heads, args.head_dim, args.value_dim or args.head_dim,
                      (None,) * args.layers, 0)


def _specs(args) -> list[tuple[str, KVConfig]]:
    names = list(PRESETS) + list(args.kv or [])
    return [(name, parse_kv(name)) for name in names]


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _estimate(g, config, ctx) -> dict:
    return estimate_bytes(config, g.n_layers, g.n_kv_heads, g.head_dim, ctx, g.value_dim, windows=list(g.windows))


def cmd_kv_estimate(args) -> int:
    g = _geometry(args)
    rows = []
    full = _estimate(g, parse_kv("full"), args.ctx)["total"]
    for name, config in _specs(args):
        est = _estimate(g, config, args.ctx)
        rows.append({"spec": name, "canonical": str(config), "bytes": est["total"],
                     "bits_per_value": est["bits_per_value"], "vs_f16": est["total"] / full})
    if args.json:
        print(json.dumps({"ctx": args.ctx, "geometry": g.__dict__, "rows": rows}, indent=2))
        return 0
    print(f"{g.n_layers} layers × {g.n_kv_heads} KV heads × {g.head_dim}, {args.ctx:,} tokens")
    print(f"{'spec':16s} {'canonical':22s} {'bytes':>16s} {'bits/value':>10s} {'vs 16-bit':>9s}")
    for r in rows:
        print(f"{r['spec']:16s} {r['canonical']:22s} {_fmt_bytes(r['bytes']):>16s} {r['bits_per_value']:10.2f} "
              f"{r['vs_f16']:9.1%}")
    return 0


def cmd_kv_sim(args) -> int:
    import numpy as np

    from .kv.paged import PagedKVCache

    g = _geometry(args)
    rng = np.random.default_rng(0)
    rows = []
    for name, config in _specs(args):
        cache = PagedKVCache(config, n_layers=g.n_layers, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim,
                             value_dim=g.value_dim, windows=list(g.windows))
        step = 512
        for layer in cache.layers:  # layer by layer keeps the synthetic batch small
            for start in range(0, args.ctx, step):
                n = min(step, args.ctx - start)
                k = rng.standard_normal((n, g.n_kv_heads, g.head_dim), dtype=np.float32)
                v = rng.standard_normal((n, g.n_kv_heads, g.value_dim), dtype=np.float32)
                layer.append(k, v)
        formula = _estimate(g, config, args.ctx)["total"]
        rows.append({"spec": name, "measured": cache.nbytes, "allocated": cache.capacity_bytes,
                     "formula": formula, "ratio": cache.nbytes / formula})
        cache.release()
    if args.json:
        print(json.dumps({"ctx": args.ctx, "rows": rows}, indent=2))
        return 0
    print(f"{g.n_layers} layers × {g.n_kv_heads} KV heads × {g.head_dim}, {args.ctx:,} tokens of synthetic K/V")
    print(f"{'spec':16s} {'measured':>14s} {'formula':>14s} {'ratio':>7s} {'allocated':>14s}")
    for r in rows:
        print(f"{r['spec']:16s} {_fmt_bytes(r['measured']):>14s} {_fmt_bytes(r['formula']):>14s} "
              f"{r['ratio']:7.4f} {_fmt_bytes(r['allocated']):>14s}")
    return 0


def _eval_derived(engine, ids, specs, args, report) -> int:
    """eval-kv --derived: each spec with its first --prefix-tokens derived from a master copy."""
    from .evaluate import evaluate_derived

    prefix = args.prefix_tokens if args.prefix_tokens is not None else (3 * args.n_tokens) // 4
    results = evaluate_derived(engine, ids, specs, prefix, master_bits=args.master_bits, progress=report)
    _end_progress()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    r0 = results[0]
    print(f"{engine.name}: first {r0['prefix_tokens']:,} tokens derived from a {args.master_bits}-bit master "
          f"copy ({_fmt_bytes(r0['master_bytes'])}); KL vs 16-bit KV over the next {r0['positions']:,} positions")
    print(f"{'spec':28s} {'direct KL':>10s} {'derived KL':>11s} {'ratio':>6s} {'top-1 dir/der':>14s}")
    for r in results:
        ratio = r["derived_kl"] / r["direct_kl"] if r["direct_kl"] else float("nan")
        print(f"{r['spec']:28s} {r['direct_kl']:10.5f} {r['derived_kl']:11.5f} {ratio:6.2f} "
              f"{r['direct_top1']:6.1%}/{r['derived_top1']:6.1%}")
    return 0


def cmd_eval_kv(args) -> int:
    from .engine import Engine, EngineError
    from .evaluate import evaluate_kv, per_layer_specs

    path = _resolve(args.model)
    _check_fit(path, args, kv="full")
    engine = Engine.load(path, kv="full")
    ids = engine.tokenizer.encode(Path(args.text_file).read_text(encoding="utf-8"), add_bos=True)
    if len(ids) < args.n_tokens + 1:
        raise EngineError(f"{args.text_file} has {len(ids):,} tokens, fewer than --n-tokens + 1")
    specs = list(args.kv or [])
    if args.per_layer:
        specs += per_layer_specs(parse_kv(specs[0] if specs else None), engine.model.n_layers)
    if not specs:
        specs = [PRESETS[name] for name in ("high-precision", "balanced", "memory-saver")]
    if args.arith != "exact" and not any(parse_kv(s) == parse_kv("full") for s in specs):
        specs.insert(0, "full")  # the arithmetic's own cost, beside each spec's
    report = _progress_printer()
    if args.derived:
        if args.arith != "exact":
            raise CLIError("--derived measures in exact arithmetic: leave out --arith")
        return _eval_derived(engine, ids[: args.n_tokens + 1], specs, args, report)
    results = evaluate_kv(engine, ids[: args.n_tokens + 1], specs, progress=report, arith=args.arith)
    _end_progress()
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
        return 0
    against = "16-bit KV" if args.arith == "exact" else f"16-bit KV in exact arithmetic, specs in {args.arith}"
    print(f"{engine.name}: {args.n_tokens:,} tokens of {Path(args.text_file).name}, vs {against}")
    print(f"{'spec':28s} {'mean KL':>9s} {'top-1':>7s} {'ppl':>8s} {'KV bytes':>12s}")
    for r in results:
        print(f"{r.spec:28s} {r.mean_kl:9.5f} {r.top1_agreement:7.2%} {r.perplexity:8.3f} {_fmt_bytes(r.kv_bytes):>12s}")
    return 0


def cmd_kv_tune(args) -> int:
    from . import kvtune
    from .engine import Engine

    if args.budget_bytes is not None and not args.ctx:
        raise CLIError("--budget-bytes needs --ctx: the context the bytes are for")
    if args.n_tokens < 1:
        raise CLIError("--n-tokens must be at least 1")
    path = _resolve(args.model)
    args.kv = "full"
    _check_fit(path, args, kv="full")
    engine = Engine.load(path, kv="full")
    windows = [w for w in engine.model.kv_geometry.windows if w is not None]
    if windows and not args.ctx:  # stderr: --json keeps stdout one object
        print(f"note: {len(windows)} of {engine.model.n_layers} layers keep only the last {min(windows):,} tokens "
              "(sliding window); without --ctx the bytes are counted per stored token, as if those layers "
              "held every token, which overprices them: give --ctx with the context the budget is for",
              file=sys.stderr)
    text_path = Path(args.text_file) if args.text_file else kvtune.DEFAULT_CALIBRATION_TEXT
    tokens = kvtune.calibration_tokens(engine, text_path.read_text(encoding="utf-8"), args.n_tokens)
    report = _progress_printer()
    result = kvtune.tune(engine, tokens, budget_like_spec=args.budget_like, bits_per_value=args.bits_per_value,
                         budget_bytes=args.budget_bytes, ctx=args.ctx, verify=not args.no_verify,
                         progress=report)
    _end_progress()
    data = result.as_dict()
    data["ctx"] = args.ctx
    if args.json:
        print(json.dumps(data))
        return 0
    profile, choice = result.profile, result.choice
    source = "stored profile" if result.from_store else f"measured in {profile.seconds:.0f} s"
    print(f"{engine.name}: {len(tokens) - 1:,} tokens of {text_path.name} ({source})")
    print(f"{'layer':>5s} {'K bits':>6s} {'V bits':>6s} {'KL of K':>9s} {'KL of V':>9s}")
    for i, (k, v) in enumerate(choice.widths):
        kl_k = profile.kl[i, 0, profile.bits.index(int(k))]
        kl_v = profile.kl[i, 1, profile.bits.index(int(v))]
        print(f"{i:5d} {int(k):6d} {int(v):6d} {kl_k:9.6f} {kl_v:9.6f}")
    where = f"at {args.ctx:,} tokens" if args.ctx else "per token"
    print(f"spec          {choice.spec}")
    print(f"bytes         {_fmt_bytes(choice.bytes)} {where} (budget {_fmt_bytes(choice.budget)}); "
          f"{result.kv_bytes_per_token:,.0f} B per token")
    print(f"predicted KL  {choice.predicted_kl:.5f}")
    if result.measured_kl is not None:
        print(f"measured KL   {result.measured_kl:.5f}")
    if result.uniform_kl is not None:
        print(f"{args.budget_like} measured KL {result.uniform_kl:.5f}"
              + (": the tuned choice was no better, so the result is that spec" if result.fell_back else ""))
    return 0


def cmd_serve(args) -> int:
    """An OpenAI-compatible server on --host:--port until interrupted."""
    from .engine import Engine
    from .serve import OpenAIServer, ServeConfig, ServeLimits, run

    model_id = Path(args.model).stem if args.model.lower().endswith(".gguf") else args.model
    config = ServeConfig(host=args.host, port=args.port, api_key=args.api_key, model_id=model_id)
    config.validate()  # a public host without a key is refused before the model loads
    path = _resolve(args.model)
    _check_fit(path, args)
    engine = Engine.load(path, kv=args.kv)
    engine.speculate = args.speculate  # drafts in the decode batches (serve.scheduler)
    _use_draft(engine, args)  # a foreign vocabulary is refused before serving
    engine.disk_cache = not args.no_disk_cache  # system prompts' KV saved under the cache folder
    limits = ServeLimits(ctx=args.ctx or engine.model.context_length, max_batch=args.max_batch,
                         kv_tokens=args.kv_tokens, queue_timeout=args.queue_timeout,
                         prefill_chunk=args.prefill_chunk)
    server = OpenAIServer(engine, limits, config)
    log.info("serving %s on http://%s:%d/v1 (batches of up to %d, context %d)%s", server.model_id,
             args.host, args.port, limits.max_batch, limits.ctx, "" if args.api_key else ", no API key")
    try:
        run(server, log_level="debug" if args.verbose else "warning" if args.quiet else "info")
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the Ctrl-C: a normal end
        pass
    return 0


# -- parser ------------------------------------------------------------------------------------
def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of every token already generated (OpenAI's; 0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted once per occurrence from the logit of tokens already generated "
                        "(OpenAI's; 0 = off)")
    p.add_argument("--seed", type=int, default=None)
    _add_speculate(p)
    _add_draft(p)


def _add_draft(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", metavar="MODEL",
                   help="draft with this small model of the same vocabulary (its own KV cache at the same "
                        "--kv) and verify in one pass, instead of --speculate; greedy output is the same")


def _add_speculate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", choices=SPECULATE_MODES, default="off",
                   help="lookup: draft from text already in the context (prompt lookup) and verify the "
                        "draft in one pass; greedy output is the same token for token (default off)")


def _kv_arg(text: str) -> str:
    try:
        parse_kv(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))
    return text


def _arith_arg(text: str) -> str:
    from .weights import check_arith

    try:
        return check_arith(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


@contextlib.contextmanager
def _arith_environment(mode: str):
    """OMLX_ARITH=mode while a command runs (the model reads it when it loads:
    weights.arith_mode), restored afterwards (main() may run in a caller's process)."""
    from .weights import ARITH_ENV

    before = os.environ.get(ARITH_ENV)
    os.environ[ARITH_ENV] = mode
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ARITH_ENV, None)
        else:
            os.environ[ARITH_ENV] = before


def _add_arith(p, *, modes: str = "exact, fast or float") -> None:
    p.add_argument("--arith", type=_arith_arg, metavar="MODE",
                   help=f"weight arithmetic, {modes}: exact (default) keeps the reference accuracy, fast "
                        "takes int8 activations as llama.cpp does (faster prefill; its cost: omlx eval-kv "
                        "--arith fast), float the float kernels (OMLX_ARITH sets the default)")


def _kv_config_arg(path: str) -> str:
    """--kv-config FILE: the file's KV setting as its canonical spec, the string --kv takes."""
    try:
        return str(KVConfig.from_file(path))
    except KVConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc))


KV_CONFIG_HELP = ("KV cache settings from a JSON or TOML file: k_bits, v_bits, layers, preset, spec, "
                  "block_size, sinks, rotation, or llama.cpp's cache_type_k/cache_type_v (not with --kv)")


def _add_kv(p: argparse.ArgumentParser, default: str | None, *, several: bool = False,
            help_text: str | None = None) -> None:
    """--kv SPEC and --kv-config FILE, one or the other; both store a spec string in args.kv
    (a list of them, in order, if `several`)."""
    group = p.add_mutually_exclusive_group()
    if several:
        group.add_argument("--kv", action="append", type=_kv_arg, metavar="SPEC", help=help_text)
        group.add_argument("--kv-config", action="append", dest="kv", type=_kv_config_arg, metavar="FILE",
                           help=KV_CONFIG_HELP + "; repeatable")
        return
    help_text = help_text or (f"KV cache: a preset ({', '.join(PRESETS)}) or a spec such as k6v4, "
                              f"k4v4,0-3:k8v8,-2..-1:k8v8 (default: {default or 'balanced'})")
    group.add_argument("--kv", type=_kv_arg, default=default, metavar="SPEC", help=help_text)
    # no default of its own: args.kv keeps --kv's unless the option is given
    group.add_argument("--kv-config", dest="kv", type=_kv_config_arg, default=argparse.SUPPRESS,
                       metavar="FILE", help=KV_CONFIG_HELP)


def _add_force(p) -> None:
    p.add_argument("--force", action="store_true",
                   help="load the model even if the memory estimate says it does not fit")


def _add_session(p) -> None:
    from .kv.paged import OVERFLOW_POLICIES

    p.add_argument("--doc", action="append", metavar="FILE",
                   help="pin a document (.txt, .md, .pdf) into the prompt prefix (repeatable)")
    p.add_argument("--ctx", type=int,
                   help="context limit in tokens (default: the model's, capped by what fits in memory)")
    p.add_argument("--doc-mode", choices=("auto", "whole", "retrieval"), default="auto",
                   help="documents in the prompt: whole, retrieval (per question, the sections that "
                        "match it best, up to --retrieval-tokens), auto (default: whole when they fit, "
                        "else retrieval)")
    p.add_argument("--overflow", choices=OVERFLOW_POLICIES, default="rolling",
                   help="at the context limit: stop, rolling (drop oldest conversation), "
                        "attention (drop least attended)")
    _add_retrieval_tokens(p)


def _retrieval_tokens_arg(value: str) -> int:
    from .retrieval import check_retrieval_tokens

    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of tokens, not {value!r}") from None
    try:
        return check_retrieval_tokens(n)
    except OmlxError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_retrieval_tokens(p) -> None:
    from .retrieval import MIN_RETRIEVAL_TOKENS, RETRIEVAL_TOKENS

    p.add_argument("--retrieval-tokens", type=_retrieval_tokens_arg, default=RETRIEVAL_TOKENS, metavar="N",
                   help=f"documents read by retrieval: per question, the best sections up to N tokens "
                        f"(default {RETRIEVAL_TOKENS}; 0: as many as the context has room for; "
                        f"else at least {MIN_RETRIEVAL_TOKENS})")


def build_parser() -> argparse.ArgumentParser:
    model_help = "a catalog name (see `omlx models list`), hf:OWNER/REPO/FILE.gguf, or a path to a .gguf file"
    parser = argparse.ArgumentParser(prog="omlx", description="Run quantized GGUF models on the CPU.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("models", help="list, fetch and locate the catalog's models")
    msub = p.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="known models and whether they are fetched")
    pf = msub.add_parser("fetch", help="download a catalog model, or a GGUF file from Hugging Face "
                         "(hf:OWNER/REPO lists a repo's files); prints its path")
    pf.add_argument("name", nargs="?", help=f"catalog name (default: {catalog.DEFAULT_MODEL}), "
                    "hf:OWNER/REPO or hf:OWNER/REPO/FILE.gguf")
    pf.add_argument("--all", action="store_true", help="fetch every catalog model")
    pf.add_argument("--force", action="store_true", help="fetch again even if present")
    pp = msub.add_parser("path", help="print where a catalog model lives")
    pp.add_argument("name")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("tokenize", help="print token ids as a JSON list")
    p.add_argument("model", help=model_help)
    p.add_argument("text")
    p.add_argument("--special", action="store_true", help="parse special tokens such as <|im_start|>")
    _add_kv(p, "full")
    p.add_argument("--bos", action="store_true", help="add BOS where the model's metadata asks for one")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("generate", help="generate text from a prompt")
    p.add_argument("model", help=model_help)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object: ids, text, stats")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the answer to JSON matching this JSON schema")
    _add_sampling(p)
    _add_kv(p, "full")
    _add_force(p)
    _add_arith(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("logprobs", help="teacher-forced log-probabilities in the reference .npz format")
    p.add_argument("model", help=model_help)
    p.add_argument("--text-file", required=True)
    p.add_argument("--n-tokens", type=int, required=True)
    p.add_argument("--out", required=True)
    _add_kv(p, "full")
    _add_force(p)
    _add_arith(p)
    p.set_defaults(func=cmd_logprobs)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("model", nargs="?", default=catalog.DEFAULT_MODEL, help=model_help)
    p.add_argument("--system", help="system prompt")
    _add_session(p)
    _add_sampling(p)
    _add_kv(p, None)
    _add_force(p)
    _add_arith(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("ask", help="questions in turn about pinned documents, with per-question stats")
    p.add_argument("model", nargs="?", default=catalog.DEFAULT_MODEL, help=model_help)
    p.add_argument("--question", action="append", help="a question (repeatable, answered in turn)")
    p.add_argument("--questions-file", help="a file with one question per line")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object: answers with stats")
    _add_session(p)
    _add_sampling(p)
    _add_kv(p, None)
    _add_force(p)
    _add_arith(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("info", help="architecture, sizes, quant types, KV bytes per token, will it fit")
    p.add_argument("model", help=model_help)
    p.add_argument("--json", action="store_true")
    p.add_argument("--ctx", type=int, help="context for the memory estimate (default: the model's)")
    p.add_argument("--draft", metavar="MODEL",
                   help="also: can this model draft for it (the same vocabulary), and the pair's memory")
    _add_kv(p, None)
    _add_arith(p)
    p.set_defaults(func=cmd_info)

    for name, func, help_text in (
        ("kv-estimate", cmd_kv_estimate, "KV-cache bytes by the formula, for each preset and --kv"),
        ("kv-sim", cmd_kv_sim, "fill a real cache with synthetic K/V; measured bytes beside the formula"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("model", nargs="?", help=model_help + " (or give --layers/--kv-heads/--head-dim)")
        p.add_argument("--layers", type=int)
        p.add_argument("--kv-heads", type=int)
        p.add_argument("--head-dim", type=int)
        p.add_argument("--value-dim", type=int, help="default: --head-dim")
        p.add_argument("--ctx", type=int, required=True, help="tokens of context")
        _add_kv(p, None, several=True, help_text="a spec besides the presets (repeatable)")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)

    p = sub.add_parser("bench", help="the standard test set: one long document, six questions, per KV spec")
    p.add_argument("model", nargs="?", default=catalog.DEFAULT_MODEL, help=model_help)
    p.add_argument("--doc", help="document (default: the GPL-3 text in resources/bench)")
    p.add_argument("--questions", help="file with one question per line (default: resources/bench/questions.txt)")
    _add_kv(p, None, several=True, help_text="KV spec (repeatable; default full, k8v8, k6v4, k4v4)")
    p.add_argument("--out", default="benchmarks/out/bench", help="folder for bench.md, bench.json, bench.png")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ctx", type=int, help="context limit (default: the model's)")
    p.add_argument("--kl-tokens", type=int, default=1024, help="document tokens for the KL column (0: skip)")
    p.add_argument("--tuned", action="store_true",
                   help="beside each quantized spec, per-layer widths tuned for its bytes (omlx kv-tune)")
    p.add_argument("--qa", action="store_true",
                   help="document QA instead: six planted facts in documents of 0.5x, 1x, 4x and 16x "
                        "the context (--ctx, default 2048), read whole or by retrieval; default KV "
                        "k8v8, k6v4, k4v4; writes bench-qa.md, .json, .png")
    p.add_argument("--qa-sizes", metavar="X,Y", help="with --qa: document sizes as multiples of the "
                   "context, ctx for a context-sized one read whole (default ctx,0.5,1,4,16)")
    p.add_argument("--qa-facts", metavar="FILE", help="with --qa: another QA set (JSON as "
                   "resources/bench/qa/facts.json; e.g. facts-heldout.json there, not tuned on)")
    p.add_argument("--qa-filler", metavar="FILE", nargs="+", help="with --qa: the texts the facts "
                   "are planted in, in turn (default: the set's \"filler\", else GPL-3 and Apache-2.0)")
    _add_retrieval_tokens(p)
    p.add_argument("--retrieval-min-ratio", type=float, default=0.0, metavar="R",
                   help="with --qa: leave out sections scoring under R times the best one (default 0: none)")
    _add_force(p)
    _add_arith(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("serve", help="an OpenAI-compatible server (chat, completions, models, metrics) "
                       "with continuous batching")
    p.add_argument("model", nargs="?", default=catalog.DEFAULT_MODEL, help=model_help)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs --api-key)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every request but /health")
    p.add_argument("--ctx", type=int, help="context per request in tokens, prompt and completion "
                   "(default: the model's)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--kv-tokens", type=int, help="KV budget in tokens per layer, shared by all requests "
                   "and the prefix cache (default: max-batch × ctx)")
    p.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds a request waits for a slot or KV budget before a 429 (default 60)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens prefilled between two decode steps (default 512; smaller keeps "
                        "running streams flowing while a long prompt is read)")
    p.add_argument("--no-disk-cache", action="store_true",
                   help="keep the prefix cache in memory only: no system prompt's KV saved to or loaded from "
                        "the cache folder ($OMLX_CACHE_DIR, default the user cache folder's omlx-desktop/prefixes)")
    _add_speculate(p)
    _add_draft(p)
    _add_kv(p, None)
    _add_force(p)
    _add_arith(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("kv-tune", help="per-layer K and V widths chosen from measured sensitivity for a byte budget")
    p.add_argument("model", help=model_help)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-like", type=_kv_arg, metavar="SPEC",
                        help="the bytes of this spec (its block size, sinks and rotation are kept)")
    budget.add_argument("--bits-per-value", type=float, metavar="X",
                        help="X stored bits per K/V value on average, scales included")
    budget.add_argument("--budget-bytes", type=int, metavar="N", help="N bytes of KV at --ctx tokens")
    p.add_argument("--ctx", type=int, help="count bytes at this many tokens (sliding-window layers hold fewer; "
                                          "without it, per stored token)")
    p.add_argument("--text-file", help="calibration text (default: the one in resources/kvtune)")
    p.add_argument("--n-tokens", type=int, default=512, help="calibration tokens (default 512)")
    p.add_argument("--no-verify", action="store_true", help="skip the evaluation of the chosen spec")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: spec, kv_bytes_per_token, predicted_kl, measured_kl, ...")
    _add_force(p)
    _add_arith(p)
    p.set_defaults(func=cmd_kv_tune)

    p = sub.add_parser("eval-kv", help="KL divergence, top-1 agreement and perplexity of KV specs vs 16-bit KV")
    p.add_argument("model", help=model_help)
    p.add_argument("--text-file", required=True)
    p.add_argument("--n-tokens", type=int, default=2048)
    _add_kv(p, None, several=True, help_text="spec to measure (repeatable)")
    p.add_argument("--per-layer", action="store_true", help="each layer alone at 4 bits, the rest at 16")
    p.add_argument("--derived", action="store_true",
                   help="compare each spec computed directly with the spec derived from a master copy "
                        "of the first --prefix-tokens (a pinned document switched to this preset)")
    p.add_argument("--master-bits", type=int, choices=(8, 16), default=8, help="the master copy's bits (default 8)")
    p.add_argument("--prefix-tokens", type=int, help="tokens derived from the master (default 3/4 of --n-tokens)")
    p.add_argument("--json", action="store_true")
    _add_force(p)
    p.add_argument("--arith", type=_arith_arg, metavar="MODE", default="exact",
                   help="the arithmetic the specs are measured in, exact (default) or fast: with fast, "
                        "the baseline stays 16-bit KV in exact arithmetic and a first row '16-bit KV' "
                        "gives the arithmetic's own cost")
    p.set_defaults(func=cmd_eval_kv)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit 0, or 2 with `omlx: error: MESSAGE` on stderr for anything the user can act on (the
    whole `OmlxError` family, bad arguments, files that cannot be read): never a traceback for
    those. Anything else is a bug: exit 1 with a one-line `omlx: internal error`, the traceback
    only under --verbose."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    try:
        if getattr(args, "arith", None) and args.func is not cmd_eval_kv:
            with _arith_environment(args.arith):
                return args.func(args) or 0
        return args.func(args) or 0
    except (OmlxError, CLIError, ValueError, OSError) as exc:
        kind, message = describe(exc)
        print(f"omlx: error: {message if kind != 'internal' else exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: say so in one line; the traceback is for -v
        if args.verbose:
            log.exception("internal error")
        print(f"omlx: internal error (a bug; `omlx -v ...` prints its traceback): {describe(exc)[1]}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
