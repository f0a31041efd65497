"""common.logs: one record is one line in either format, whatever a field's value holds (a tenant that opted in
to text logging can put any prompt there)."""

from __future__ import annotations

import json
import logging

import pytest

from common.logs import JsonFormatter, TextFormatter

NASTY = 'first line\nERROR forged: admin=1 "quoted" tab\there'


def _record(**fields: object) -> logging.LogRecord:
    r = logging.LogRecord("kvgate.test", logging.INFO, __file__, 1, "request finished", None, None)
    r.fields = fields
    return r


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter()], ids=["json", "text"])
def test_a_record_with_line_breaks_in_a_value_stays_one_line(formatter: logging.Formatter) -> None:
    line = formatter.format(_record(prompt=NASTY, tokens=3))
    assert "\n" not in line and "\r" not in line


def test_text_quotes_values_that_would_be_ambiguous_and_leaves_plain_ones() -> None:
    line = TextFormatter().format(_record(prompt=NASTY, status="stop", tokens=3, empty=""))
    assert line.endswith(f" prompt={json.dumps(NASTY)} status=stop tokens=3 empty=\"\"")


def test_json_fields_are_top_level_keys() -> None:
    rec = json.loads(JsonFormatter().format(_record(prompt=NASTY, tokens=3)))
    assert rec["prompt"] == NASTY and rec["tokens"] == 3 and rec["msg"] == "request finished"
