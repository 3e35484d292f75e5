"""Counts, failures and skips read from pytest's ``-v -rfEs`` output, for a report; from the
per-test lines (``[gw3] [ 12%] FAILED tests/...``) where a killed run printed no summary."""

from __future__ import annotations

import re
from dataclasses import dataclass

COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
SUMMARY_PREFIXES = ("FAILED", "ERROR", "SKIPPED", "XPASS", "XFAIL")
PROGRESS = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)")
PROGRESS_WORDS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors",
                  "SKIPPED": "skipped", "XFAIL": "xfailed", "XPASS": "xpassed"}


@dataclass
class SuiteOutcome:
    counts: dict[str, int]
    failures: list[str]  # FAILED and ERROR lines of the short summary
    skips: list[str]  # SKIPPED lines: their count, place and reason
    final_line: str


def parse_pytest(output: str) -> SuiteOutcome:
    """Counts and short-summary lines from pytest's ``-q -rfEs`` output."""
    lines = output.splitlines()
    final = next((ln.strip("= ") for ln in reversed(lines)
                  if re.search(r"\bin [\d.]+s\b", ln) and (COUNT.search(ln) or "no tests" in ln)),
                 "")
    counts: dict[str, int] = {}
    for number, word in COUNT.findall(final):
        word = "errors" if word.startswith("error") else word
        counts[word] = counts.get(word, 0) + int(number)
    summary = [ln for ln in lines if ln.startswith(SUMMARY_PREFIXES)]
    failures = [ln for ln in summary if ln.startswith(("FAILED", "ERROR"))]
    if not final:  # killed before its summary: what the per-test lines say so far
        for word, node in (m.groups() for ln in lines if (m := PROGRESS.search(ln))):
            name = PROGRESS_WORDS[word]
            counts[name] = counts.get(name, 0) + 1
            if word in ("FAILED", "ERROR"):
                failures.append(f"{word} {node}")
    return SuiteOutcome(counts, failures, [ln for ln in summary if ln.startswith("SKIPPED")],
                        final)


def suite_body(outcome: SuiteOutcome) -> str:
    parts = []
    if outcome.failures:
        parts += ["Failures:", "", "```", *outcome.failures, "```"]
    if outcome.skips:
        parts += ["", "Skipped:", "", "```", *outcome.skips, "```"]
    return "\n".join(parts)
