"""`omlx bench`: the standard test set. One fixed long document and six fixed questions, run for
each KV spec in one process, so that tuning is judged on the same work every time.

With `tuned`, each quantized uniform spec also gets a tuned one beside it: per-layer K and V widths
chosen by engine.kvtune for the same bytes (profile measured on the shipped calibration text, or
read from the profile store), reported as "tuned@SPEC".

For each spec: a fresh prefix cache (no disk reuse, so question 1 is cold and pays for reading
the document), the six questions in turn (each on its own, as `omlx ask`), RSS and KV bytes
sampled 4x/s on a background thread, then teacher-forced KL of the spec against 16-bit KV over
the document's first tokens. Writes `bench.md` (table), `bench.json` and `bench.png` (RSS and
KV bytes over time per spec) into --out.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .memory import rss_bytes

RESOURCES = Path(__file__).resolve().parents[1] / "resources"
DEFAULT_DOC = RESOURCES / "bench" / "gpl-3.txt"
DEFAULT_QUESTIONS = RESOURCES / "bench" / "questions.txt"
KL_TOKENS = 1024  # teacher-forced tokens of the document for the KL column


@dataclass
class SpecResult:
    spec: str
    tuned_for: str | None = None  # the uniform spec whose bytes a tuned spec was chosen for
    peak_rss_bytes: int = 0
    kv_bytes: int = 0
    ttft_cold_s: float = 0.0
    ttft_cached_s: float = 0.0
    cached_share: float = 0.0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    mean_kl: float | None = None
    answers: list[str] = field(default_factory=list)
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (s, rss, kv bytes)


class _Sampler:
    """RSS and the engine's KV bytes every `interval` s on a daemon thread."""

    def __init__(self, kv_bytes, interval: float = 0.25):
        self.kv_bytes, self.interval = kv_bytes, interval
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                kv = int(self.kv_bytes())
            except Exception:  # a pool growing under us: take the next sample
                kv = self.samples[-1][2] if self.samples else 0
            self.samples.append((time.perf_counter() - self._t0, rss_bytes(), kv))
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def tuned_specs(engine, specs: list[str], progress=None) -> dict[str, str]:
    """{uniform spec: tuned spec at its bytes} for each spec with no layer at 16 bits."""
    from . import kvtune
    from .kv.config import parse_kv

    tokens = kvtune.calibration_tokens(engine, kvtune.DEFAULT_CALIBRATION_TEXT.read_text())
    out = {}
    for spec in specs:
        widths = kvtune.spec_widths(parse_kv(spec), engine.model.n_layers)
        if set(widths.ravel()) <= set(kvtune.CANDIDATE_BITS):
            if progress:
                progress(f"{spec}: tuning per-layer widths for its bytes")
            out[spec] = kvtune.tune(engine, tokens, budget_like_spec=spec, verify=False).choice.spec
    return out


def run_bench(engine, specs: list[str], *, doc: Path = DEFAULT_DOC, questions: list[str] | None = None,
              max_tokens: int = 32, ctx: int | None = None, kl_tokens: int = KL_TOKENS,
              progress=None, tuned: bool = False) -> list[SpecResult]:
    from .evaluate import evaluate_kv
    from .session import Session

    tuned_for: dict[str, str] = {}
    if tuned:
        for uniform, spec in tuned_specs(engine, specs, progress).items():
            if spec not in specs and spec not in tuned_for:  # a tuned spec equal to a listed one runs once
                tuned_for[spec] = uniform
        specs = list(specs) + list(tuned_for)
    questions = questions or read_questions(DEFAULT_QUESTIONS)
    text = doc.read_text()
    saved_disk = engine.disk_cache
    engine.disk_cache = False  # question 1 must be cold for every spec
    results = []
    try:
        for spec in specs:
            engine.set_kv(spec)
            result = SpecResult(spec=str(engine.kv_config), tuned_for=tuned_for.get(spec))
            session = Session(engine, ctx=ctx)
            session.add_document(text=text, name=doc.name, prefill=False)
            stats = []
            with _Sampler(lambda: engine.kv_usage()[0]) as sampler:
                for i, q in enumerate(questions):
                    if progress:
                        progress(f"{spec}: question {i + 1}/{len(questions)}")
                    r = session.ask(q, max_tokens=max_tokens).result
                    stats.append(r.stats)
                    result.answers.append(r.text)
            session.close()
            result.timeline = sampler.samples
            result.peak_rss_bytes = max([s.peak_rss_bytes for s in stats] + [m[1] for m in sampler.samples])
            result.kv_bytes = max(s.kv_bytes for s in stats)
            result.ttft_cold_s = stats[0].ttft_s
            result.prefill_tok_s = stats[0].prefill_tok_s
            later = stats[1:] or stats
            result.ttft_cached_s = float(np.mean([s.ttft_s for s in later]))
            # Share of the pinned prefix (system turn + document) the later questions found cached.
            prefix = max(1, session.prefix_tokens())
            result.cached_share = min(min(s.cached_tokens for s in later), prefix) / prefix
            result.decode_tok_s = float(np.mean([s.decode_tok_s for s in stats if s.decode_tok_s]))
            results.append(result)
        if kl_tokens:
            if progress:
                progress("KL vs 16-bit KV")
            ids = engine.tokenizer.encode(text, add_bos=True)[: kl_tokens + 1]
            for result, quality in zip(results, evaluate_kv(engine, ids, [r.spec for r in results])):
                result.mean_kl = quality.mean_kl
    finally:
        engine.disk_cache = saved_disk
    return results


def read_questions(path: Path) -> list[str]:
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip() and not line.startswith("#")]


def llama_cpp_row(model_path: Path, text: str, question: str, max_tokens: int) -> dict | None:
    """llama.cpp (llama-cpp-python) on the same model and prompt, when it happens to be
    importable: prefill and decode tokens/s, 2 threads. Never a dependency."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(model_path), n_ctx=8192, n_threads=2, verbose=False)
    prompt = llm.tokenize(f"{text}\n\nQuestion: {question}\nAnswer:".encode())
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    n = 0
    for _ in llm.generate(prompt, temp=0.0, reset=False):
        n += 1
        if n >= max_tokens:
            break
    t2 = time.perf_counter()
    return {"prefill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": n / max(t2 - t1, 1e-9)}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def write_report(results: list[SpecResult], out: Path, *, model: str, doc: Path, n_questions: int,
                 llama_cpp: dict | None = None) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    base = next((r for r in results if r.spec in ("k16v16", "full", "f16")), results[0])
    lines = [
        f"# omlx bench: {model}",
        "",
        f"Document: {doc.name}; {n_questions} questions, each answered on its own; one process.",
        "",
        "| KV | peak RSS MiB | KV MiB | TTFT cold s | TTFT cached s | cached share | decode tok/s | KL vs 16-bit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kl = "—" if r.mean_kl is None else f"{r.mean_kl:.5f}"
        name = f"tuned@{r.tuned_for}: {r.spec}" if r.tuned_for else r.spec
        lines.append(f"| {name} | {_mib(r.peak_rss_bytes)} | {_mib(r.kv_bytes)} | {r.ttft_cold_s:.2f} | "
                     f"{r.ttft_cached_s:.3f} | {r.cached_share:.1%} | {r.decode_tok_s:.1f} | {kl} |")
    if llama_cpp:
        lines.append(f"| llama.cpp (f16 KV) | | | | | | {llama_cpp['decode_tok_s']:.1f} | |")
        lines.append("")
        lines.append(f"llama.cpp prefill {llama_cpp['prefill_tok_s']:.1f} tok/s vs ours "
                     f"{base.prefill_tok_s:.1f} ({base.prefill_tok_s / llama_cpp['prefill_tok_s']:.2f}x); "
                     f"decode {llama_cpp['decode_tok_s']:.1f} vs {base.decode_tok_s:.1f} tok/s "
                     f"({base.decode_tok_s / llama_cpp['decode_tok_s']:.2f}x)")
    md = out / "bench.md"
    md.write_text("\n".join(lines) + "\n")
    data = out / "bench.json"
    data.write_text(json.dumps({"model": model, "document": doc.name, "llama_cpp": llama_cpp,
                                "results": [asdict(r) for r in results]}, indent=1))
    paths = {"markdown": md, "json": data}
    png = _plot(results, out / "bench.png", model)
    if png is not None:
        paths["png"] = png
    return paths


def _plot(results: list[SpecResult], path: Path, model: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax_rss, ax_kv) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:
        if not r.timeline:
            continue
        t, rss, kv = (np.array(c, dtype=float) for c in zip(*r.timeline))
        ax_rss.plot(t, rss / 2**20, label=f"tuned@{r.tuned_for}" if r.tuned_for else r.spec)
        ax_kv.plot(t, kv / 2**20, label=r.spec)
    ax_rss.set_ylabel("process RSS (MiB)")
    ax_kv.set_ylabel("KV bytes in use (MiB)")
    ax_kv.set_xlabel("seconds since the spec's first question")
    ax_rss.set_title(f"omlx bench: {model}")
    ax_rss.legend(loc="lower right", fontsize="small")
    ax_rss.grid(alpha=0.3)
    ax_kv.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# -- omlx bench --qa: documents longer than the context ----------------------------------------
QA_DIR = RESOURCES / "bench" / "qa"
QA_FACTS = QA_DIR / "facts.json"
QA_FILLER = (RESOURCES / "bench" / "gpl-3.txt", QA_DIR / "apache-2.0.txt")
# document tokens as multiples of the context; "ctx": a context-sized document read whole, the
# cold read a retrieval question's TTFT is compared with
QA_SIZES = ("ctx", 0.5, 1.0, 4.0, 16.0)
QA_CTX = 2048


def normalize_answer(text: str) -> str:
    """Lower case, a minus sign before a digit spelled "minus", everything but letters and
    digits (of any script: "蓝色的柜子" stays) removed: "-31 degrees" and "Minus 31" both
    contain "minus31"."""
    import re

    text = re.sub(r"(?<![\w])-(?=\d)", " minus ", text.lower())
    return re.sub(r"[\W_]+", "", text)


def is_correct(answer: str, accepted: list[str]) -> bool:
    got = normalize_answer(answer)
    return any(normalize_answer(a) in got for a in accepted)


def read_facts(path: Path = QA_FACTS) -> dict:
    """A QA set: {"facts": [{"fact", "question", "answers"}, ...], "depths": [one per fact,
    0..1]} and optionally "filler": the texts the facts are planted in, as paths relative to
    the file (default QA_FILLER), resolved here into Paths.

    Raises:
        ValueError: the file is not such a set (the message says what is wrong).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("facts"), list) \
            or not isinstance(data.get("depths"), list):
        raise ValueError(f"{path}: a QA set is an object with a \"facts\" list and a \"depths\" list")
    if len(data["facts"]) != len(data["depths"]):
        raise ValueError(f"{path}: one depth per fact")
    if not all(isinstance(d, (int, float)) and 0 <= d <= 1 for d in data["depths"]):
        raise ValueError(f"{path}: each depth is a fraction of the way through, 0 to 1")
    for i, fact in enumerate(data["facts"], 1):
        if not isinstance(fact, dict) or not all(isinstance(fact.get(k), str) for k in ("fact", "question")) \
                or not isinstance(fact.get("answers"), list) or not fact["answers"]:
            raise ValueError(f"{path}: fact {i} needs \"fact\", \"question\" and a list of \"answers\"")
        if not all(isinstance(a, str) and normalize_answer(a) for a in fact["answers"]):
            # an answer that normalizes to nothing would be contained in every reply
            raise ValueError(f"{path}: fact {i} has an answer without a letter or digit")
    filler = data.get("filler")
    if filler is not None:
        if not isinstance(filler, list) or not filler or not all(isinstance(f, str) for f in filler):
            raise ValueError(f"{path}: \"filler\" is a list of text files (relative to {path.parent})")
        data["filler"] = [path.parent / f for f in filler]
    else:
        data["filler"] = list(QA_FILLER)
    return data


def qa_document(tokenizer, n_tokens: int, facts: dict, filler=None) -> str:
    """Filler paragraphs (the ``filler`` texts in turn, default the set's, again from the start
    when they run out) up to about ``n_tokens`` tokens, with each fact as a paragraph of its own
    at its depth (a fraction of the way through)."""
    paragraphs = []
    for path in filler or facts.get("filler") or QA_FILLER:
        paragraphs += [p.strip() for p in Path(path).read_text().split("\n\n") if p.strip()]
    if not paragraphs:
        raise ValueError("the QA filler texts hold no paragraph")
    counts = [len(tokenizer.encode(p)) + 2 for p in paragraphs]
    fact_tokens = sum(len(tokenizer.encode(f["fact"])) + 2 for f in facts["facts"])
    body: list[str] = []
    ends: list[int] = []  # tokens up to the end of each paragraph of the body
    total, i = 0, 0
    while total + counts[i % len(paragraphs)] <= max(n_tokens - fact_tokens, counts[0]):
        body.append(paragraphs[i % len(paragraphs)])
        total += counts[i % len(paragraphs)]
        ends.append(total)
        i += 1
    # each fact after the paragraph where its depth's token falls; deepest first, so earlier
    # insertions do not move the later positions
    for depth, fact in sorted(zip(facts["depths"], facts["facts"]), key=lambda x: -x[0]):
        at = next((j + 1 for j, end in enumerate(ends) if end >= depth * total), len(body))
        body.insert(at, fact["fact"])
    return "\n\n".join(body)


@dataclass
class QARow:
    spec: str
    size: float              # document tokens / context ("ctx" for the context-sized reference)
    doc_tokens: int
    mode: str                # how the document was read: "whole" or "retrieval"
    correct: int
    n_questions: int
    ttft_cold_s: float       # the first question, nothing cached
    ttft_cached_s: float     # the first question again: its prompt prefix reused
    ttft_mean_s: float       # over the questions (each retrieves its own sections)
    kv_bytes: int
    prompt_tokens: int       # the first question's prompt
    answers: list[str] = field(default_factory=list)
    retrieval_tokens: int = 0    # the session's retrieval budget (0: the room the context leaves)
    min_ratio: float = 0.0       # the session's retrieval cut-off (a fraction of the best score)
    ttft_later_s: float = 0.0    # mean over the questions after the first
    prefilled_mean: float = 0.0  # tokens prefilled per question (prompt less cached), mean


def run_qa(engine, specs: list[str], *, ctx: int = QA_CTX, sizes=QA_SIZES, max_tokens: int = 24,
           facts_path: Path = QA_FACTS, filler=None, retrieval_tokens: int | None = None,
           retrieval_min_ratio: float = 0.0, progress=None) -> list[QARow]:
    """For each KV spec and size: a document of that many contexts (the set at ``facts_path``
    planted in ``filler``, default the set's) read in auto mode (whole when it fits, else
    retrieval with ``retrieval_tokens``, default the session's; "ctx": a context-sized one read
    whole, the reference cold read), its questions asked in turn and the first one again. The
    disk cache is off so the first question of each document is cold."""
    from .session import ANSWER_RESERVE, RETRIEVAL_TOKENS, Session

    budget = RETRIEVAL_TOKENS if retrieval_tokens is None else retrieval_tokens

    facts = read_facts(facts_path)
    questions = [(f["question"], f["answers"]) for f in facts["facts"]]
    saved_disk = engine.disk_cache
    engine.disk_cache = False
    rows: list[QARow] = []
    try:
        _warm_up(engine, progress)  # with the disk cache off: nothing it saves is read back
        for spec in specs:
            engine.set_kv(spec)
            cases = [(s, ctx - ANSWER_RESERVE - 96 if s == "ctx" else int(s * ctx)) for s in sizes]
            for size, n_tokens in cases:
                engine.prefix_cache().clear()
                text = qa_document(engine.tokenizer, n_tokens, facts, filler)
                session = Session(engine, ctx=ctx, doc_mode="whole" if size == "ctx" else "auto",
                                  retrieval_tokens=budget, retrieval_min_ratio=retrieval_min_ratio)
                label = "ctx" if size == "ctx" else f"{size:g}x"
                doc = session.add_document(text=text, name=f"qa-{label}.txt", prefill=False)
                stats, answers, correct = [], [], 0
                for i, (q, accepted) in enumerate(questions):
                    if progress:
                        progress(f"{engine.kv_config} {label} ({doc.mode}): question {i + 1}/{len(questions)}")
                    r = session.ask(q, max_tokens=max_tokens).result
                    stats.append(r.stats)
                    answers.append(r.text.strip())
                    correct += is_correct(r.text, accepted)
                again = session.ask(questions[0][0], max_tokens=max_tokens).result
                session.close()
                rows.append(QARow(
                    spec=str(engine.kv_config), size=size, doc_tokens=doc.n_tokens, mode=doc.mode,
                    correct=correct, n_questions=len(questions), ttft_cold_s=stats[0].ttft_s,
                    ttft_cached_s=again.stats.ttft_s,
                    ttft_mean_s=float(np.mean([s.ttft_s for s in stats])),
                    kv_bytes=max(s.kv_bytes for s in stats + [again.stats]),
                    prompt_tokens=stats[0].prompt_tokens, answers=answers,
                    retrieval_tokens=budget if doc.mode == "retrieval" else 0,
                    min_ratio=retrieval_min_ratio if doc.mode == "retrieval" else 0.0,
                    ttft_later_s=float(np.mean([s.ttft_s for s in stats[1:]] or [stats[0].ttft_s])),
                    prefilled_mean=float(np.mean([s.prompt_tokens - s.cached_tokens for s in stats]))))
                if progress:
                    r = rows[-1]
                    progress(f"{r.spec} {label}: {r.mode}, {r.correct}/{r.n_questions} correct, TTFT cold "
                             f"{r.ttft_cold_s:.2f} s, later {r.ttft_later_s:.2f} s, cached {r.ttft_cached_s:.3f} s, "
                             f"prefilled {r.prefilled_mean:.0f} tokens per question, "
                             f"KV {r.kv_bytes:,} bytes, answers {r.answers}")
    finally:
        engine.disk_cache = saved_disk
    return rows


def _warm_up(engine, progress=None) -> None:
    """The kernels compiled or loaded (engine.warmup runs them in the background) and one short
    prompt answered, so the first cold read measures prefill, not compilation."""
    from .kernels import background
    from .session import Session

    t0 = time.perf_counter()
    background.wait(timeout=600)
    session = Session(engine, ctx=256)
    session.ask("Say hello.", max_tokens=2).result
    session.close()
    engine.prefix_cache().clear()
    if progress:
        progress(f"warm-up: kernels ready and a short prompt answered in {time.perf_counter() - t0:.1f} s")


def write_qa_report(rows: list[QARow], out: Path, *, model: str, ctx: int,
                    facts_path: Path = QA_FACTS, filler=None) -> dict[str, Path]:
    """bench-qa.md, .json and .png in ``out``; the set and the filler (default the set's) named
    in the table's heading and the JSON."""
    out.mkdir(parents=True, exist_ok=True)
    filler = [Path(f).name for f in (filler or read_facts(facts_path)["filler"])]
    lines = [
        f"# omlx bench --qa: {model}, context {ctx:,}",
        "",
        f"QA set {Path(facts_path).name}, planted in {', '.join(filler)}.",
        "",
        "Facts planted at spread depths; an answer counts when it contains one of the fact's "
        "answers (normalized). Auto mode: whole when the document fits, else retrieval. The ctx "
        "row is a context-sized document read whole: the cold read a retrieval question is "
        "compared with. Budget: the retrieval budget in tokens (0: the room the context leaves); "
        "TTFT later: the mean over the questions after the first; prefilled: tokens prefilled "
        "per question (prompt less cached).",
        "",
        "| KV | size | doc tokens | read | budget | correct | TTFT cold s | TTFT later s | TTFT cached s "
        "| prefilled | prompt tokens | KV MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = "ctx" if r.size == "ctx" else f"{r.size:g}×"
        budget = f"{r.retrieval_tokens:,}" if r.mode == "retrieval" else "–"
        if r.mode == "retrieval" and r.min_ratio:
            budget += f", ≥{r.min_ratio:g}× best"
        lines.append(f"| {r.spec} | {size} | {r.doc_tokens:,} | {r.mode} | {budget} | {r.correct}/{r.n_questions} | "
                     f"{r.ttft_cold_s:.2f} | {r.ttft_later_s:.2f} | {r.ttft_cached_s:.3f} | "
                     f"{r.prefilled_mean:,.0f} | {r.prompt_tokens:,} | {_mib(r.kv_bytes)} |")
    md = out / "bench-qa.md"
    md.write_text("\n".join(lines) + "\n")
    data = out / "bench-qa.json"
    data.write_text(json.dumps({"model": model, "ctx": ctx, "facts": Path(facts_path).name,
                                "filler": filler, "rows": [asdict(r) for r in rows]}, indent=1))
    paths = {"markdown": md, "json": data}
    png = _plot_qa(rows, out / "bench-qa.png", model, ctx)
    if png is not None:
        paths["png"] = png
    return paths


def _plot_qa(rows: list[QARow], path: Path, model: str, ctx: int) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    specs = list(dict.fromkeys(r.spec for r in rows))
    sized = [r for r in rows if r.size != "ctx"]
    sizes = list(dict.fromkeys(r.size for r in sized))
    fig, (ax_ok, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(specs), 1)
    for k, spec in enumerate(specs):
        mine = {r.size: r for r in sized if r.spec == spec}
        xs = [i + k * width for i in range(len(sizes))]
        ax_ok.bar(xs, [mine[s].correct if s in mine else 0 for s in sizes], width, label=spec)
        ax_t.plot([f"{s:g}×" for s in sizes], [mine[s].ttft_cold_s if s in mine else np.nan for s in sizes],
                  marker="o", label=f"{spec} cold")
        ax_t.plot([f"{s:g}×" for s in sizes], [mine[s].ttft_cached_s if s in mine else np.nan for s in sizes],
                  marker="x", linestyle="--", label=f"{spec} cached")
        ref = next((r for r in rows if r.spec == spec and r.size == "ctx"), None)
        if ref is not None:
            ax_t.axhline(ref.ttft_cold_s, color="grey", linestyle=":", label=f"{spec} ctx-sized cold read")
    ax_ok.set_xticks([i + width * (len(specs) - 1) / 2 for i in range(len(sizes))], [f"{s:g}×" for s in sizes])
    n_questions = max((r.n_questions for r in rows), default=6)
    ax_ok.set_ylim(0, n_questions + 0.5)
    ax_ok.set_ylabel(f"correct answers (of {n_questions})")
    ax_ok.set_xlabel("document size / context")
    ax_ok.legend(fontsize="small")
    ax_t.set_ylabel("TTFT (s)")
    ax_t.set_xlabel("document size / context")
    ax_t.legend(fontsize="x-small")
    fig.suptitle(f"omlx bench --qa: {model}, context {ctx:,}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
