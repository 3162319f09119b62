"""The causal claim across runs: its table per corpus, its sentences (the primary answer, each entry in words) and
where it holds — read from the dose–response runs' own tables (docs/method.md §5, §8 v3).

Runs are :class:`posgen_tl.report.runs.Run` records (``study``, ``model``, ``corpus``, ``folder``, ``meta``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from posgen_tl.report.text import md_table, sig3

if TYPE_CHECKING:
    from posgen_tl.report.runs import Run

__all__ = ["CLAIM_STUDY", "claim_table", "claim_tables", "claim_agreement", "confirmations", "claim_section", "claim_method",
           "claim_discussion", "primary_answer", "headline_rows"]


#: the study whose runs make up the causal claim (the dose–response test, docs/method.md §5, §8 v3)
CLAIM_STUDY = "causal"


def claim_table(runs: list[Run], corpus: str) -> tuple[pd.DataFrame | None, str]:
    """The causal claim of ``corpus``'s :data:`CLAIM_STUDY` runs: one row per declared entry (model × layer group)
    with its run's destroy − none at common damage (``estimate``, ``ci_low``, ``ci_high``, ``p``), its
    intersection–union ``p_iut`` and binding contrast, the run's own verdict (``run_verdict``), ``p_family`` (Holm
    over the WHOLE declared claim of each entry's ``p_test`` — its intersection–union p, or 1 where its contrasts
    point different ways; entries not run or not testable count as p = 1, which keeps the adjustment valid) and
    the claim's ``verdict``: "depends" where the entry's own test rejected (``iut_rejects``, before any family
    step) and ``p_family`` < the runs' α. ``family`` / ``family_size`` / ``family_method``: the declared claim each
    entry's ``p_family`` is adjusted over (its entries joined by commas), its size and the adjustment in words.

    A corpus may hold several claims when they share no entry — e.g. two confirmatory tests, one per model, each
    declared as its own one-entry family: each is adjusted over its own entries only.

    Returns ``(table indexed by entry, method text)``; ``(None, reason)`` when no run declares a claim or the runs
    declare claims that overlap without being the same (or different levels α)."""
    from posgen_tl.stats.verdicts import family_adjust  # noqa: PLC0415

    rows, alphas, claims = [], set(), []
    for r in (r for r in runs if r.corpus == corpus and r.study == CLAIM_STUDY):
        declared = tuple(r.meta["config"].get("claim") or ())
        if not declared:
            continue
        claim = tuple(json.loads((r.folder / f"{CLAIM_STUDY}_result.json").read_text())["meta"].get("claim")
                      or declared)
        claims += [claim] if claim not in claims else []  # declared, whether or not the run has verdict rows
        alphas.add(float(r.meta["config"].get("test_alpha", 0.05)))
        v = pd.read_csv(r.folder / f"{CLAIM_STUDY}_verdicts.csv")
        con = pd.read_csv(r.folder / f"{CLAIM_STUDY}_contrasts.csv").set_index(["layers", "contrast"])
        for x in v.itertuples():
            b = con.loc[(x.layers, x.binding)] if isinstance(x.binding, str) and (x.layers, x.binding) in con.index \
                else None
            rows.append(dict(entry=f"{r.model}:{x.layers}", claim=claim, model=r.model, layers=x.layers,
                             estimate=x.estimate, ci_low=x.ci_low, ci_high=x.ci_high, p=x.p, p_iut=x.p_iut,
                             p_test=x.p_test, iut_rejects=bool(x.iut_rejects), binding=x.binding,
                             run_verdict=x.verdict, mde=x.mde, n_docs=x.n_docs, reason=str(x.reason),
                             effect=float(r.meta["config"].get("effect", np.nan)),
                             binding_estimate=np.nan if b is None else float(b["estimate"]),
                             binding_ci_low=np.nan if b is None else float(b["ci_low"]),
                             binding_ci_high=np.nan if b is None else float(b["ci_high"])))
    if not claims:
        return None, "no run declares a claim"
    entries = [e for c in claims for e in c]
    if len(entries) != len(set(entries)) or len(alphas) != 1:
        return None, "The runs declare different claims (or levels α): no family verdict."
    alpha = next(iter(alphas))
    frames, methods = [], []
    for claim in claims:
        mine = [r for r in rows if r["claim"] == claim]
        df = pd.DataFrame(mine, columns=list(mine[0]) if mine else ["entry", "run_verdict", "p_test", "n_docs",
                                                                       "iut_rejects"]).drop(columns="claim", errors="ignore")
        df = df.set_index("entry").reindex(list(claim))
        df["family"] = ",".join(claim)
        missing = [e for e in claim if pd.isna(df.loc[e, "run_verdict"])]
        p_adj, method = family_adjust(df["p_test"].fillna(1.0).to_numpy(), "holm", list(claim))
        method += f" (not run: {', '.join(missing)}, counted as p = 1)" if missing else ""
        df["p_family"], df["alpha"], df["family_size"], df["family_method"] = p_adj, alpha, len(claim), method
        verdicts = []
        for e, q, rv, n in zip(claim, p_adj, df["run_verdict"], df["n_docs"].fillna(0)):
            if e in missing:
                verdicts.append("not run")
            elif rv == "not testable":
                verdicts.append("not testable")
            else:
                rejects = bool(df.loc[e, "iut_rejects"])  # the entry's own test, before any family adjustment
                verdicts.append(("depends" if rejects and q < alpha else "not detected")
                                + (" (exploratory)" if n < 32 else ""))
        df["verdict"] = verdicts
        frames.append(df)
        methods.append(method if len(claims) == 1 else f"{', '.join(claim)}: {method}")
    return pd.concat(frames), "; ".join(methods)


def _section_rows(df: pd.DataFrame, corpus: str | None = None) -> list[dict[str, str]]:
    """The rows of :func:`claim_section`'s tables (``corpus``: a first column naming it)."""
    rows = []
    for entry, r in df.iterrows():
        ran = r["verdict"] != "not run"
        rows.append({**({"corpus": corpus} if corpus else {}), "entry": entry,
                     "answer": r["verdict"] + (" (contrasts point different ways)" if _split(r) else ""),
                     "destroy − none": _interval(r["estimate"], r["ci_low"], r["ci_high"]) if ran else "–",
                     "deciding contrast": (f"{r['binding']}: "
                                           f"{_interval(r['binding_estimate'], r['binding_ci_low'], r['binding_ci_high'])}"
                                           if isinstance(r["binding"], str) and r["binding"] else "–"),
                     "its p": sig3(r["p_test"]), "p over the claim": sig3(r["p_family"]) if ran else "–",
                     "documents": "–" if r["n_docs"] != r["n_docs"] else str(int(r["n_docs"]))})
    return rows


_ITS_P = ("its p: the largest p of the intersection–union test (destroy − none and destroy − every control), 1 where "
          "the contrasts point different ways")


def claim_section(runs: list[Run]) -> list[str]:
    """The causal claim across runs as small tables with word headers: per corpus of the exploratory claim
    (:func:`claim_tables`), and one table of every confirmatory test (each its own declared family, a corpus column):
    per declared entry its answer, destroy − none at common damage, the contrast that decided (its effect and
    interval), that contrast's p (the intersection–union p), the p over the declared claim and the documents. The
    verdict of the claim is these tables', and the headlines quote them."""
    out: list[str] = []
    exploratory, confirmatory = claim_tables(runs)
    for corpus in dict.fromkeys(r.corpus for r in runs):
        if corpus not in exploratory:
            if corpus not in confirmatory and (method := claim_table(runs, corpus)[1]).startswith("The runs"):
                out += [f"*The declared claim on {corpus}*", "", method, ""]  # claims that cannot be read together
            continue
        part = exploratory[corpus]
        how = "; ".join(dict.fromkeys(str(x) for x in part["family_method"]))
        out += [f"*The declared claim on {corpus}* (effects in nats × p at common damage, 95 % intervals)", "",
                md_table(pd.DataFrame(_section_rows(part))), "",
                f"<small>{_ITS_P}; p over the claim: {how}; α = 0.05.</small>", ""]
    rows = [x for c, t in confirmatory.items() for x in _section_rows(t, c)]
    if rows:
        out += ["*The confirmatory tests*, each declared before its run on documents no exploratory run saw, each its "
                "own family (effects in nats × p at common damage, 95 % intervals)", "",
                md_table(pd.DataFrame(rows)), "",
                f"<small>{_ITS_P}; p over the claim: Holm over the entries of each test's own declared claim; "
                "α = 0.05.</small>", ""]
    return out


def claim_method(runs: list[Run]) -> list[str]:
    """How the claim table is computed, in words (folded under the answer)."""
    if not any(r.study == CLAIM_STUDY for r in runs):
        return []
    return ["The claim was declared before the runs: a list of (model, layer group) entries. Per entry, "
            "destroy − none is the tolerance loss of removing the pattern minus that of no edit, both read at the same "
            "declared damage levels on each document's dose–response curve (interpolation only). The entry's test is "
            "an intersection–union test: destroy − none AND destroy − every control must reject in the same direction "
            "(exact sign-flip over documents), so its p is the largest of those p's, and the contrast that has it "
            "decides. Over the claim, the entries' p's are adjusted together (entries not run or not testable count "
            "as p = 1).", ""]


def _signed(x: Any) -> str:
    t = sig3(x)
    return t if t.startswith(("-", "–")) else "+" + t


def claim_tables(runs: list[Run]) -> tuple[dict[str, pd.DataFrame], dict[str, pd.DataFrame]]:
    """``(exploratory, confirmatory)``: per corpus, the rows of the claim table (:func:`claim_table`) that belong to
    the exploratory claim (the claim declared on the most corpora; ties: pydoc's), and the rows of every other claim —
    a confirmatory test declared before its run on documents of its own, read on its own. Split per declared claim,
    so a corpus may appear in both."""
    corpora = list(dict.fromkeys(r.corpus for r in runs if r.study == CLAIM_STUDY))
    tables = {c: t for c in corpora if (t := claim_table(runs, c)[0]) is not None}
    if not tables:
        return {}, {}
    # the exploratory claim is the one declared on the most corpora (ties: the one declared on pydoc); a claim's
    # entries compared as a set, so a claim declared in another order is the same claim
    fams = {c: {frozenset(f.split(",")): f for f in dict.fromkeys(t["family"])} for c, t in tables.items()}
    counts = [k for f in fams.values() for k in f]
    ref = max(counts, key=lambda k: (counts.count(k), k in fams.get("pydoc", {})))

    def part(c: str, t: pd.DataFrame, keep: bool) -> pd.DataFrame:
        return t[t["family"].isin([f for k, f in fams[c].items() if (k == ref) == keep])]

    exploratory = {c: part(c, t, True) for c, t in tables.items() if ref in fams[c]}
    confirmatory = {c: part(c, t, False) for c, t in tables.items() if any(k != ref for k in fams[c])}
    return exploratory, confirmatory


def claim_agreement(runs: list[Run]) -> dict[str, str]:
    """Per entry of the exploratory claim (:func:`claim_tables`): whether its corpora agree — ``"yes"`` (the same
    tested verdict on at least two corpora, each run of ≥ 32 documents), ``"same verdict; not a replication"`` (a
    run is exploratory), ``"not testable on <corpus>"``, ``"NO — the corpora disagree"`` or ``"one corpus only"``."""
    tables = claim_tables(runs)[0]
    out = {}
    for e in dict.fromkeys(e for t in tables.values() for e in t.index):
        said = {c: str(t.loc[e, "verdict"]) for c, t in tables.items()
                if e in t.index and t.loc[e, "verdict"] != "not run"}
        words = {v.split(" (")[0] for v in said.values()}
        untestable = [c for c, v in said.items() if v.startswith("not testable")]
        if len(said) < 2:
            out[e] = "one corpus only"
        elif untestable:
            out[e] = f"not testable on {' and '.join(untestable)}"
        elif len(words) > 1:
            out[e] = "NO — the corpora disagree"
        elif any("exploratory" in v for v in said.values()):
            out[e] = "same verdict; not a replication (fewer than 32 documents)"
        else:
            out[e] = "yes"
    return out


def headline_rows(runs: list[Run]) -> list[dict[str, str]]:
    """The causal rows of the README's headline table: one per entry of the exploratory claim (its first corpus,
    pydoc where it ran) and one per entry of each confirmatory test. Each gives the entry, its answer, the contrast
    its test's p belongs to (the binding contrast of the intersection–union test, with its 95 % interval; "–" where
    the entry is not testable, with the reason), that p and its Holm adjustment over the declared family, the
    documents, and whether the second corpus agrees (:func:`claim_agreement`). Keys: ``entry, corpus, answer,
    effect, p, n, second``."""
    exploratory, confirmatory = claim_tables(runs)
    agree = claim_agreement(runs)
    out = []

    def row(entry: str, corpus: str, r: pd.Series, second: str, n_entries: int, confirm: bool = False) -> dict[str, str]:
        testable = not str(r["verdict"]).startswith("not testable") and isinstance(r["binding"], str) and r["binding"]
        why = str(r.get("reason", "")).split(":")[0].strip()
        effect = (f"{r['binding']} at common damage (nats × p): "
                  f"{_interval(r['binding_estimate'], r['binding_ci_low'], r['binding_ci_high'])}" if testable
                  else f"– ({why})" if why else "–")
        if testable and _split(r):  # the test's p is 1: say why, and whose p the smaller number is
            effect += f"; the contrasts point different ways, so the test's p is 1 (this contrast's own p {sig3(r['p_iut'])})"
        family = int(r["family_size"]) if "family_size" in r and r["family_size"] == r["family_size"] else n_entries
        p = (f"{sig3(r['p_test'])} (its test); {sig3(r['p_family'])} (Holm over {family})" if testable else "–")
        answer = _plain(str(r["verdict"]), confirm)
        if testable and r["mde"] == r["mde"] and r["effect"] == r["effect"]:  # power, stated beside the verdict
            answer += (f"; MDE {sig3(r['mde'])} {'≤' if r['mde'] <= r['effect'] else '>'} {sig3(r['effect'])}: "
                       f"{'powered' if r['mde'] <= r['effect'] else 'not powered'}")
        return dict(entry=entry, corpus=corpus, answer=answer, effect=effect, p=p,
                    n="–" if r["n_docs"] != r["n_docs"] else str(int(r["n_docs"])), second=second)

    if exploratory:
        first = min(exploratory, key=lambda c: (c != "pydoc", c))
        t = exploratory[first]
        out += [row(e, first, r, agree.get(e, "one corpus only"), len(t)) for e, r in t.iterrows()
                if r["verdict"] != "not run"]
    for c, t in confirmatory.items():
        out += [row(e, c, r, "confirmatory: fresh documents", len(t), True) for e, r in t.iterrows()
                if r["verdict"] != "not run"]
    return out


def _split(r: pd.Series) -> bool:
    """Whether an entry's contrasts point different ways (its test's p is 1 whatever the binding contrast's p)."""
    return bool(r["p_test"] == r["p_test"] and r["p_iut"] == r["p_iut"] and float(r["p_test"]) != float(r["p_iut"]))


def _plain(verdict: str, confirmatory: bool) -> str:
    """A verdict as a confirmatory test's row says it: "(exploratory)" there only means fewer than 32 documents."""
    return verdict.replace("(exploratory)", "(fewer than 32 documents)") if confirmatory else verdict


def _effect_of(runs: list[Run], entry: str, corpus: str) -> float:
    """The smallest effect of interest declared by the run of ``entry`` (``model:layers``) on ``corpus`` (NaN if none)."""
    model = entry.split(":", 1)[0]
    run = next(r for r in runs if r.study == CLAIM_STUDY and r.model == model and r.corpus == corpus)
    return float(run.meta["config"].get("effect", float("nan")))


def confirmations(runs: list[Run], *, short: bool = False) -> list[str]:
    """One sentence per entry of a confirmatory test (:func:`claim_tables`): its corpus, documents, verdict with
    the numbers that decided it, and its power (the whole test's MDE against the run's smallest effect of
    interest). ``short``: the verdict and the power only (for an answer sentence; the numbers stay in the
    discussion)."""
    out = []
    for c, t in claim_tables(runs)[1].items():
        for entry, row in t.iterrows():
            if row["verdict"] == "not run":
                continue
            effect = _effect_of(runs, entry, c)
            if str(row["verdict"]).startswith("not testable"):  # no test ran: power is beside the point, the reason is not
                why = str(row.get("reason", "")).split(";")[0].strip()
                out.append(f"Confirmatory test of {entry.replace(':', ' ')} on {int(row['n_docs'])} fresh documents "
                           f"({c}, declared before its run): not testable" + (f" — {why}" if why else "") + ".")
                continue
            if short:
                power = ("" if effect != effect else
                         f", {'powered' if float(row['mde']) <= effect else 'NOT powered'} (the whole test's MDE "
                         f"{sig3(row['mde'])} vs the effect of interest {sig3(effect)} nats × p)")
                out.append(f"Confirmatory test of {entry.replace(':', ' ')} on {int(row['n_docs'])} fresh documents "
                           f"({c}, declared before its run): {_plain(str(row['verdict']), True)}"
                           f"{_deciding(row, effect)}{power}.")
                continue
            power = ("" if effect != effect else
                     f"; {'powered' if float(row['mde']) <= effect else 'NOT powered'} for the smallest effect of "
                     f"interest {sig3(effect)} nats × p")
            out.append(f"Confirmatory test (its own family, declared before its run), run on {int(row['n_docs'])} "
                       f"documents no exploratory run saw ({c}): {_entry_clauses(entry, {c: row})}{power}.")
    return out


def _deciding(row: pd.Series, effect: float) -> str:
    """For a "depends": `` — <binding contrast> at common damage <effect> [<interval>], p <p> (…)``, the contrast
    whose p decided the test, and whether it is smaller than the effect of interest; otherwise nothing."""
    if not str(row["verdict"]).startswith("depends") or row["binding_estimate"] != row["binding_estimate"]:
        return ""
    small = (f"; smaller than the effect of interest {sig3(effect)} nats × p"
             if effect == effect and abs(float(row["binding_estimate"])) < effect else "")
    return (f" — {row['binding']} at common damage "
            f"{_interval(row['binding_estimate'], row['binding_ci_low'], row['binding_ci_high'])} nats × p, p "
            f"{sig3(row['p_iut'])} (the largest of its intersection–union test{small})")


def _confirmed(runs: list[Run]) -> list[str]:
    """The entries whose confirmatory test says "depends" at 32 documents or more and was powered (the whole
    test's MDE at most its run's smallest effect of interest)."""
    out = []
    for c, t in claim_tables(runs)[1].items():
        for entry, row in t.iterrows():
            effect = _effect_of(runs, entry, c)
            if str(row["verdict"]) == "depends" and float(row["mde"]) <= effect:
                out.append(entry.replace(":", " "))
    return list(dict.fromkeys(out))


def claim_discussion(runs: list[Run]) -> list[str]:
    """Where the causal claim holds and where it does not, per declared entry, written from the runs' tables:
    the hypothesis; per corpus, the entry's destroy − none at common damage, what decided its verdict (the
    binding contrast of the intersection–union test, or why it is not testable) and the verdict over the
    claim; whether the corpora agree."""
    tables = claim_tables(runs)[0]
    if not tables:
        return []
    first = min(tables, key=lambda c: (c != "pydoc", c))
    out = ["## Where the causal claim holds and where it does not", "",
           "The hypothesis under test: a model's tolerance of swapped context tokens relies on the key offset "
           "in the fast RoPE bands (the pattern), so removing that offset (`destroy`) raises the cost of swaps "
           "(the area under ΔNLL over the swap fraction p) by more than edits that do the SAME damage to the clean "
           "text but leave the pattern alone (controls C1–C4), compared along dose–response curves. Per declared "
           "entry, from the runs' own tables:", ""]
    stands, fails, single, untestable, not_run = [], [], [], [], []
    for entry in tables[first].index:
        model, layers = entry.split(":", 1)
        lines, verdicts = [], {}
        for c, t in tables.items():
            if entry not in t.index or t.loc[entry, "verdict"] == "not run":
                continue
            row = t.loc[entry]
            run = next(r for r in runs if r.study == CLAIM_STUDY and r.model == model and r.corpus == c)
            v = pd.read_csv(run.folder / f"{CLAIM_STUDY}_verdicts.csv").set_index("layers").loc[layers]
            verdicts[c] = str(row["verdict"])
            lines.append(
                f"    - {c} ({int(row['n_docs'])} documents): destroy − none at common damage {_signed(row['estimate'])} "
                f"nats × p [{_signed(row['ci_low'])}, {_signed(row['ci_high'])}], sign-flip p {sig3(float(row['p']))}. "
                f"Decided by: {v['reason']}. Over the claim: **{row['verdict']}** (p {sig3(float(row['p_family']))}).")
        words = {w.split(" (")[0] for w in verdicts.values()}
        if not verdicts:
            state = "not run yet"
            not_run.append(entry)
        elif len(verdicts) < 2:
            state = "measured on one corpus only: not claimed"
            single.append(entry)
        elif words == {"depends"}:
            state = "**the claim holds here** (both corpora)"
            stands.append(entry)
        elif "not testable" in words:
            state = "not testable on at least one corpus: not claimed"
            untestable.append(entry)
        elif len(words) == 1:
            state = "the claim is not supported here (not detected on either corpus)"
            fails.append(entry)
        else:
            state = "the corpora disagree: not claimed"
            fails.append(entry)
        out += [f"- **{model}, layers {layers}** — {state}.", *lines]
    said = [f"{what} {', '.join(es)}" for what, es in (("the claim holds (both corpora) for", stands),
                                                        ("it is not supported for", fails),
                                                        ("it is not testable for", untestable),
                                                        ("only one corpus has been run for", single),
                                                        ("not run yet:", not_run)) if es]
    out += ["", "In short: " + "; ".join(said) + ". 'Not detected' is not evidence of no effect: each run's page gives "
            "the minimum detectable effect of the whole test.", ""]
    conf = confirmations(runs)
    if conf:
        out += ["### The confirmatory test", "", *conf, ""]
    return out


def primary_answer(runs: list[Run]) -> str:
    """One plain sentence answering the primary question (does tolerance depend on the pattern?) from the
    causal claim on the corpora that ran it — or saying that it has no published answer yet."""
    q, a = primary_claim(runs)
    return f"**{q}** {a}"


def primary_claim(runs: list[Run]) -> tuple[str, str]:
    """``(question, answer)`` of :func:`primary_answer` (the answer links ``{prefix}causal.md``)."""
    q = "Does position tolerance depend on the key pattern in the fast RoPE bands?"
    tables = claim_tables(runs)[0]
    if not tables:
        return q, ("No published answer yet: the earlier verdicts were withdrawn (their controls never did "
                   "destroy's damage), and the dose–response re-runs that replace them are under way "
                   "([causal]({prefix}causal.md)).")
    entries = list(dict.fromkeys(e for t in tables.values() for e in t.index))
    words = {e: {c: str(t.loc[e, "verdict"]).split(" (")[0] for c, t in tables.items() if e in t.index
                 and t.loc[e, "verdict"] != "not run"} for e in entries}
    holds = [e for e, w in words.items() if len(w) >= 2 and set(w.values()) == {"depends"}]
    ran = [e for e, w in words.items() if w]
    both = [e for e, w in words.items() if len(w) >= 2]
    confirmed = _confirmed(runs)
    if holds:
        ans = f"Yes for {', '.join(holds)} (on both corpora); not established for the other {len(ran) - len(holds)} entries run"
    elif confirmed:
        ans = (f"Yes for {', '.join(confirmed)} in a powered confirmatory test on fresh documents; not established "
               f"elsewhere: no entry of the exploratory claim shows a dependence on both corpora ({len(both)} of "
               f"{len(entries)} entries run on both so far, {len(ran) - len(both)} on one)")
    else:
        ans = (f"Not established: no entry of the claim shows a dependence on both corpora ({len(both)} of "
               f"{len(entries)} entries run on both so far, {len(ran) - len(both)} on one)")
    short = []
    for e in entries:
        if not words[e]:
            continue
        said = {c: str(t.loc[e, "verdict"]) for c, t in tables.items() if c in words[e]}
        short.append(f"{e.replace(':', ' ')} {next(iter(said.values()))} on {' and '.join(said)}"
                     if len(set(said.values())) == 1 else
                     f"{e.replace(':', ' ')} " + ", ".join(f"{v} on {c}" for c, v in said.items()))
    per = (" Per entry: " + "; ".join(short) + ".") if short else ""
    conf = " ".join(confirmations(runs, short=True))
    return q, f"{ans} ([causal]({{prefix}}causal.md)).{per}" + (f" {conf}" if conf else "")


def _interval(est: float, lo: float, hi: float) -> str:
    return f"{sig3(est)} [{sig3(lo)}, {sig3(hi)}]"


def _parts(row: pd.Series) -> tuple[str, str, dict[str, str]]:
    """``(verdict word, kind of clause, numbers)`` of one entry on one corpus: the kind is "untestable", "depends",
    "adjusted" (every contrast rejects at the test's level, the adjustment over the claim does not), "none" (no change
    detected) or "control" (a cost, not beyond a control at the same damage)."""
    verdict = str(row["verdict"])
    nums = {"dn": _interval(row["estimate"], row["ci_low"], row["ci_high"]), "mde": sig3(row["mde"]),
            "p": sig3(row["p_iut"]),
            "why": str(row.get("reason", "")).split(":")[0].strip() or "the rule's preconditions failed",
            "b": (f"{row['binding']} {_interval(row['binding_estimate'], row['binding_ci_low'], row['binding_ci_high'])}"
                  if row["binding_estimate"] == row["binding_estimate"] else str(row["binding"]))}
    if verdict.startswith("not testable"):
        return verdict, "untestable", nums
    if verdict.startswith("depends"):
        return verdict, "depends", nums
    alpha = float(row.get("alpha", 0.05))
    if str(row.get("iut_rejects", False)) == "True" and float(row["p_iut"]) < alpha <= float(row.get("p_family", 1.0)):
        # every contrast rejects at the test's level, but not after the adjustment over the claim
        nums["pf"], nums["alpha"] = sig3(row["p_family"]), sig3(alpha)
        return verdict, "adjusted", nums
    if str(row["binding"]) == "destroy − none" or not row["ci_low"] > 0:
        return verdict, "none", nums
    return verdict, "control", nums


def _clause(kind: str, n: dict[str, str]) -> str:
    """The words after the verdict; ``n``'s values may list several corpora's numbers."""
    if kind == "untestable":
        return n["why"]
    if kind == "depends":
        return (f"destroy − none (nats × p) {n['dn']}, beyond every control at common damage (weakest: {n['b']}, "
                f"p {n['p']})")
    if kind == "adjusted":
        return (f"destroy − none (nats × p) {n['dn']} and destroy − every control at common damage reject in one "
                f"direction at level {n['alpha']} (weakest: {n['b']}, p {n['p']}), but not after the adjustment for "
                f"the claim's entries (p {n['pf']})")
    if kind == "none":
        return f"no change of tolerance by removing the pattern is detected (destroy − none (nats × p) {n['dn']}; " \
               f"the whole test's MDE {n['mde']})"
    return (f"removing the pattern costs tolerance (destroy − none (nats × p) {n['dn']}), but not detectably more than a "
            f"control with the same damage ({n['b']}; the whole test's MDE {n['mde']})")


def _entry_clauses(entry: str, rows: dict[str, pd.Series]) -> str:
    """One entry of the claim in words over the corpora that ran it: where verdict and reason agree, once ("not
    detected on pydoc and readmes — …", each number given per corpus); where they differ, per corpus."""
    name = entry.replace(":", " ")
    parts = {c: _parts(r) for c, r in rows.items()}
    if len(parts) > 1 and len({(v, k) for v, k, _ in parts.values()}) == 1:
        verdict, kind, _ = next(iter(parts.values()))
        merged = {}
        for key in next(iter(parts.values()))[2]:
            vals = {c: n[key] for c, (_, _, n) in parts.items()}
            merged[key] = (next(iter(vals.values())) if len(set(vals.values())) == 1
                           else ", ".join(f"{v} on {c}" for c, v in vals.items()))
        return f"{name}: {verdict} on {' and '.join(parts)} — {_clause(kind, merged)}"
    return "; ".join(f"{name} ({c}): {v} — {_clause(k, n)}" for c, (v, k, n) in parts.items())


def _entry_clause(entry: str, corpus: str, row: pd.Series) -> str:
    """One entry of the claim in words on one corpus (:func:`_entry_clauses`)."""
    return _entry_clauses(entry, {corpus: row})
