"""`bertpipe inspect`: a plain-text summary of a store."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..errors import OptionError
from ..run.record import carried_phrase, superseded_phrase
from ..spec import ViewSpec
from ..stores.opened import StoreData as Store
from ..stores.provenance import RuntimeChoice


def describe(store: Store) -> str:
    docs = store.docs
    prov = store.provenance
    n = int(docs.sizes.get("doc", 0))
    status = np.asarray(docs["status"].values)
    truncated = np.asarray(docs["truncated"].values, dtype=bool)
    n_tokens = np.asarray(docs["n_tokens"].values)
    lines = [
        f"store      {store.path} ({store.format}, format version {prov.format_version})",
        f"rows       {n}" + _superseded_share(store),
        f"coverage   {int((status == 'ok').sum())} ok, {int((status != 'ok').sum())} empty, "
        f"{int(truncated.sum())} truncated; {int(n_tokens.sum())} tokens in documents",
        "views",
    ]
    for name in store.views:
        spec = prov.view_spec(name)
        post = prov.post.get(name)
        text = _view_text(spec) if spec else f"from view {post.source if post else '?'}"
        if post:
            text += f", post {post.method} (fitted on {post.fitted_rows} rows)"
        lines.append(f"  {name:<12} width {docs[name].shape[1]:<5} {text}")
    lines.extend(_token_view_lines(store))
    lines.extend(_chunk_lines(store))
    model = prov.model
    lines += [
        f"model      {model.path} ({model.model_type})",
        "weights    " + ", ".join(f"{k} sha256:{v[:12]}" for k, v in
                                   model.weights_sha256.items()),
        f"ran on     {', '.join(prov.device)} ({', '.join(prov.dtype)}), {prov.created}",
        *_choice_lines(prov.runtime_choice),
        # the software that wrote it ("version" above and "versions kept" are the store's)
        "software   " + ", ".join(f"{k} {v}" for k, v in prov.versions.items()),
    ]
    lines.extend(_history_lines(store))
    return "\n".join(lines)


def _choice_lines(choice: RuntimeChoice | None) -> list[str]:
    """How model.runtime and model.dtype were resolved, and the calibration's table."""
    if choice is None:
        return []
    by = {"job": "set by the job", "calibration": "measured by calibration",
          "cache": "from a cached calibration"}.get(choice.by, choice.by)
    lines = [f"runtime    {choice.runtime} {choice.dtype} ({by})"]
    for row in choice.table:
        verdict = "chosen" if row.chosen else "agrees" if row.agrees else f"out: {row.note}"
        lines.append(f"           {f'{row.runtime} {row.dtype}':<18} "
                     f"{_number(row.tokens_per_s, '>9,.0f')} tokens/s  min cosine "
                     f"{_number(row.min_cosine, '.6f')}  {verdict}")
    return lines


def _number(value: object, spec: str) -> str:
    """A recorded number as `spec` formats it; anything else as it was recorded (a store
    written from a calibration cache of the wrong types, before those were measured
    again, still shows: the store is read as it is)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return repr(value)


def _superseded_share(store: Store) -> str:
    """Rows and counts below include the rows edits superseded: say how many."""
    superseded = int(store.superseded().sum())
    return (f" (of which {superseded} superseded by an edit: counted in coverage and "
            "chunks, not in the vocabulary fit or geometry)") if superseded else ""


def _flagged(store: Store) -> tuple[int, int]:
    """Rows an incremental run kept with present=false: (ids gone from the input, rows an
    edit superseded)."""
    if "present" not in store.docs:
        return 0, 0
    flagged = int((~np.asarray(store.docs["present"].values, dtype=bool)).sum())
    superseded = int(store.superseded().sum())
    return flagged - superseded, superseded


def _history_lines(store: Store) -> list[str]:
    """The store's version and one line per run that wrote it, oldest first."""
    prov = store.provenance
    gone, superseded = _flagged(store)
    said = [f"{gone} rows flagged present=false (ids gone from the input)"] if gone else []
    if superseded:
        said.append(f"{superseded} rows superseded by an edit (present=false; the id's "
                    "current row follows)")
    lines = [f"version    {prov.version}" + "".join(f"; {s}" for s in said)]
    readable = store.fmt.version_numbers()
    if len(readable) > 1:
        lines.append(f"{' ' * 11}versions kept: {', '.join(map(str, readable))} "
                     "(open_store(path, version=k); bertpipe gc --keep N reclaims the rest)")
    lines += _reader_version_lines(store)
    for i, run in enumerate(prov.history):
        head = "history    " if i == 0 else " " * 11
        what = f"{run.added} added"
        if run.kind == "incremental":
            kept = "" if not run.gone else " (pruned)" if run.pruned else " (kept)"
            what += (f", {run.replaced} replaced, {run.unchanged} unchanged, {run.gone} "
                     f"gone{kept}")
            what += superseded_phrase(run.superseded, run.dropped)
            what += carried_phrase(run.carried_changed)
        lines.append(f"{head}{run.started}  {run.kind:<11} v{run.version}  {run.rows} rows: "
                     f"{what}; encoded {run.encoded} ({run.copied} copied), {run.tokens} "
                     f"tokens, {run.wall_s:.1f}s; input {run.input_rows} rows in "
                     f"{run.input_files} file{'s' * (run.input_files != 1)}")
        if run.took_over_lock:
            lines.append(f"{' ' * 11}  took over {run.took_over_lock}")
    return lines


def _reader_version_lines(store: Store) -> list[str]:
    """Per kept version, what a reader without bertpipe opens: a Delta store's table
    versions (a bertpipe version is several commits of each table), an Icechunk store's
    snapshot."""
    lines = []
    for entry in store.fmt.reader_versions():
        if "tables" in entry:
            named = ", ".join(f"{level} {n}" for level, n in entry["tables"].items())
            lines.append(f"v{entry['version']}: Delta table versions {named}")
        elif "snapshot" in entry:
            lines.append(f"v{entry['version']}: snapshot {entry['snapshot']}")
    return [f"{'readers    ' if i == 0 else ' ' * 11}{line}" for i, line in enumerate(lines)]


def _view_text(spec: ViewSpec) -> str:
    layers = list(spec.layers) if isinstance(spec.layers, tuple) else spec.layers
    text = f"pooling {spec.pooling}, layers {layers}"
    if spec.combine != "none":
        text += f", combine {spec.combine}"
    if spec.normalize:
        text += ", normalized"
    return text


def _token_view_lines(store: Store) -> list[str]:
    """Token views (pooling: tokens) and the size of the tokens level."""
    data = store.token_dataset
    if data is None or not store.token_views:
        return []
    lines = []
    for name in store.token_views:
        spec = store.provenance.view_spec(name)
        text = _view_text(spec) if spec else ""
        lines.append(f"  {name:<12} width {data[name].shape[1]:<5} {text}")
    n = int(data.sizes.get("piece", 0))
    per_doc = np.asarray(store.docs["token_count"].values)
    lines.append(f"tokens     {n} stored (special tokens left out, each token once), "
                 f"per document max {int(per_doc.max()) if len(per_doc) else 0}")
    return lines


def _chunk_lines(store: Store) -> list[str]:
    n_chunks = np.asarray(store.docs["n_chunks"].values)
    ok = n_chunks > 0
    if not ok.any():
        return ["chunks     none"]
    per_doc = n_chunks[ok]
    line = (f"chunks     {int(n_chunks.sum())} in all; per document min {int(per_doc.min())}, "
            f"median {float(np.median(per_doc)):g}, max {int(per_doc.max())}; "
            f"{100 * float((per_doc > 1).mean()):.1f}% of documents chunked")
    lines = [line]
    stats = store.provenance.stats
    if "tokens_covered" in stats:
        total, covered = stats["tokens"], stats["tokens_covered"]
        share = 100 * covered / total if total else 100.0
        encoded = (f"; {stats['tokens_encoded']} encoded (special tokens and overlap "
                   "included)" if "tokens_encoded" in stats else "")
        lines.append(f"           tokens covered {covered} of {total} ({share:.1f}%){encoded}")
    return lines


def geometry_rows(store: Store, pairs: int = 2000, seed: int = 0,
                  max_rows: int = 20000) -> tuple[int, list[dict[str, Any]]]:
    """Per view and fix (raw, center, whiten, abtt d=1): mean cosine of random pairs, top-PC
    share, mean norm, all fitted on the same rows (a fixed-seed sample of at most
    `max_rows`). Returns (rows sampled, one dict per view and fix; `too_few` for a view
    with fewer than two non-empty documents)."""
    from ..post.geometry import fit, stats

    if pairs < 1:
        raise OptionError(f"--sample: {pairs} pairs; use at least 1")
    current = np.flatnonzero(~store.superseded())  # not the rows an edit superseded
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(current, size=min(len(current), max_rows), replace=False))
    out: list[dict[str, Any]] = []
    for view in store.views:
        x = np.asarray(store.docs[view].values[rows], dtype=np.float64)
        x = x[np.isfinite(x).all(axis=1)]
        if len(x) < 2:  # pairs and a covariance need two documents with text
            out.append({"view": view, "fix": None, "too_few": int(len(x))})
            continue
        for label, params in GEOMETRY_FIXES:
            y = x if params is None else fit(x, **params).apply(x)
            out.append({"view": view, "fix": label, **stats(y, pairs=pairs, seed=seed)})
    return len(rows), out


GEOMETRY_FIXES: list[tuple[str, dict[str, Any] | None]] = [
    ("raw", None), ("center", {"method": "center"}), ("whiten", {"method": "whiten"}),
    ("abtt d=1", {"method": "abtt", "d": 1})]


def describe_geometry(store: Store, pairs: int = 2000, seed: int = 0,
                      max_rows: int = 20000) -> str:
    """`geometry_rows` as a table."""
    n, rows = geometry_rows(store, pairs, seed, max_rows)
    lines = [f"geometry   {n} rows, mean cosine over {pairs} random pairs (seed {seed})",
             f"  {'view':<12}{'fix':<10}{'mean cos':>10}{'top PC':>9}{'mean norm':>11}"]
    for r in rows:
        if r["fix"] is None:
            lines.append(f"  {r['view']:<12}{r['too_few']} non-empty documents: too few to "
                         "measure")
            continue
        lines.append(f"  {r['view']:<12}{r['fix']:<10}{r['mean_cosine']:>10.3f}"
                     f"{r['top_pc_share']:>9.3f}{r['mean_norm']:>11.3f}")
    return "\n".join(lines)


def store_facts(store: Store) -> dict[str, Any]:
    """What `inspect` prints, as one JSON-ready dict (`bertpipe inspect --json`)."""
    docs, prov = store.docs, store.provenance
    status = np.asarray(docs["status"].values)
    n_chunks = np.asarray(docs["n_chunks"].values)
    per_doc = n_chunks[n_chunks > 0]
    gone, superseded = _flagged(store)
    kept = store.fmt.version_numbers()  # store versions open_store(path, version=k) opens
    views = []
    for name in store.views:
        spec, post = prov.view_spec(name), prov.post.get(name)
        entry: dict[str, Any] = {"name": name, "width": int(docs[name].shape[1])}
        if spec is not None:
            entry.update(pooling=spec.pooling, combine=spec.combine, normalize=spec.normalize,
                         layers=list(spec.layers) if isinstance(spec.layers, tuple)
                         else spec.layers)
        if post is not None:
            entry["post"] = dataclasses.asdict(post)
        views.append(entry)
    return {
        "path": store.path, "format": store.format, "format_version": prov.format_version,
        "complete": prov.complete, "rows": int(docs.sizes.get("doc", 0)),
        "coverage": {"ok": int((status == "ok").sum()), "not_ok": int((status != "ok").sum()),
                     "truncated": int(np.asarray(docs["truncated"].values, bool).sum()),
                     "tokens": int(np.asarray(docs["n_tokens"].values).sum())},
        "views": views,
        "chunks": {"total": int(n_chunks.sum()),
                   "per_document": ({"min": int(per_doc.min()),
                                     "median": float(np.median(per_doc)),
                                     "max": int(per_doc.max())} if len(per_doc) else None),
                   "share_chunked": float((per_doc > 1).mean()) if len(per_doc) else 0.0},
        "model": {"path": prov.model.path, "type": prov.model.model_type,
                  "weights_sha256": prov.model.weights_sha256},
        "device": prov.device, "dtype": prov.dtype, "created": prov.created,
        "software_versions": prov.versions, "stats": prov.stats,
        "version": prov.version, "versions_kept": kept,
        "reader_versions": store.fmt.reader_versions(),
        # the keys these had before (deprecated): scripts written against them keep working
        "versions": prov.versions, "readable_versions": kept,
        "flagged_gone": gone,
        "superseded": superseded,
        "history": [dataclasses.asdict(run) for run in prov.history],
        "runtime_choice": (dataclasses.asdict(prov.runtime_choice)
                           if prov.runtime_choice else None),
    }
