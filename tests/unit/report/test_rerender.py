"""Re-rendering a finished report (posgen_tl.report.run.report_sections): a stage saved before Results kept their
own config is rendered with the config the report recorded for it, not an empty one."""

from __future__ import annotations

from types import SimpleNamespace

from posgen_tl.report import run as report_run


class _Result:
    def __init__(self, tables, config, meta):
        self.tables, self.config, self.meta = tables, config, meta


def test_a_legacy_stage_is_rendered_with_the_reports_record_of_its_config(monkeypatch, tmp_path):
    seen = {}
    saved = {"pattern": _Result({}, {}, {}), "tolerance": _Result({}, {"n_seq": 64}, {})}

    def render(result):
        seen[len(seen)] = dict(result.config)
        return SimpleNamespace(paragraphs=[], results={}, findings=[])

    monkeypatch.setattr(report_run.registry, "load", lambda name, folder: saved[name])
    monkeypatch.setattr(report_run.registry, "experiment", lambda name: SimpleNamespace(render=render))
    report_run.report_sections(tmp_path, ["pattern", "tolerance"], preset="full", model_name="m",
                               configs={"pattern": {"n_seq": 12}, "tolerance": {"n_seq": 7}})
    assert seen == {0: {"n_seq": 12}, 1: {"n_seq": 64}}  # the empty config is filled; a kept one is never replaced
