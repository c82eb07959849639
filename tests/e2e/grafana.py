"""What a person sees on the Grafana dashboard, computed from query results: a small model of Grafana's own rules.

tests/e2e/test_grafana_panels.py renders every panel of monitoring/grafana/dashboard.json against a real
Prometheus with it; tests/unit/repo/test_monitoring.py checks the rules on hand-made panel snippets. Pure: no I/O, the
caller passes the query functions.

The rules, as Grafana applies them (packages/grafana-data: the display processor, getValueMappingResult,
getActiveThreshold, field overrides):

* template variables: `$name`, `${name}`, `${name:format}` and `[[name]]` are replaced; an unknown one is an error
  here (Grafana would send it to Prometheus as is);
* field config: the panel's `fieldConfig.defaults`, then every override whose matcher matches the field
  (`byName` = display name, `byRegexp`, `byFrameRefID`), property by property; what is still missing takes
  Grafana's defaults (thresholds green, red from 80; colour mode "thresholds", except timeseries: palette);
* value mappings first, in their order: `value` (the number as JavaScript prints it, `1` not `1.0`), `range`,
  `regex`, `special` (null, nan, null+nan, true, false, empty). A mapping's text and colour win;
* then the colour mode: `thresholds` -> the last step whose value <= the number (steps sorted, the base step's
  null is -inf; null and NaN take the base step), `fixed`/`shades` -> the fixed colour, palettes -> "palette"
  (a series colour that says nothing about the value);
* no data: the panel shows `noValue` (else "No data"); a stat/gauge/bar gauge colours it like a null value.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

ALL = ".*"  # the dashboard's allValue for $node

RED = frozenset({"red", "dark-red", "semi-dark-red", "light-red", "super-light-red",
                 "#f2495c", "#c4162a", "#e02f44", "#ff7383", "#ffa6b0"})
GREEN = frozenset({"green", "dark-green", "semi-dark-green", "light-green", "super-light-green",
                   "#73bf69", "#37872d", "#56a64b", "#96d98d", "#c8f2c2"})

DEFAULT_THRESHOLDS = {"mode": "absolute", "steps": [{"color": "green", "value": None}, {"color": "red", "value": 80}]}
DEFAULT_COLOR_MODE = {"timeseries": "palette-classic", "barchart": "palette-classic", "piechart": "palette-classic",
                      "state-timeline": "continuous-GrYlRd", "status-history": "continuous-GrYlRd"}
STAT_LIKE = {"stat", "gauge", "bargauge"}


def is_red(colour: str | None) -> bool:
    return colour is not None and colour.lower() in RED


def is_green(colour: str | None) -> bool:
    return colour is not None and colour.lower() in GREEN


# ------------------------------------------------------------------------------------------- template variables

_VARIABLE = re.compile(r"\$\{(\w+)(?::[\w-]+)?\}|\[\[(\w+)\]\]|\$(\w+)")
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|\\]")


def interpolate(text: str, variables: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in variables:
            raise KeyError(f"${name} is not a variable the test sets (in {text!r})")
        return variables[name]

    return _VARIABLE.sub(one, text)


def regex_value(selected: list[str] | None) -> str:
    """What Grafana's Prometheus datasource writes for a multi-value variable used in `=~"..."`: the allValue for
    All (None), one regex-escaped value, or `(a|b)` for several."""
    if selected is None:
        return ALL
    escaped = [_REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), v) for v in selected]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


# --------------------------------------------------------------------------------------------------- panels

def panels(dashboard: dict) -> list[dict]:
    """Every panel that queries something, including those in (collapsed) rows."""
    out: list[dict] = []

    def walk(items: list[dict]) -> None:
        for p in items:
            if p.get("type") != "row":
                out.append(p)
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return out


def legend(fmt: str | None, labels: dict[str, str]) -> str:
    """A series' display name from the target's legendFormat (`{{label}}`; empty or __auto: name{labels})."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*([\w:]+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest else (name or "Value")


def _js_regex(pattern: str) -> re.Pattern:
    """Grafana's stringToJsRegex: `/body/flags`, else the whole string anchored."""
    m = re.fullmatch(r"/(.*)/([gimsuy]*)", pattern, flags=re.S)
    if m:
        return re.compile(m.group(1), re.I if "i" in m.group(2) else 0)
    return re.compile(f"^{pattern}$")


def _matches(matcher: dict, name: str, ref_id: str) -> bool:
    kind, option = matcher["id"], matcher.get("options")
    if kind == "byName":
        return name == option
    if kind == "byRegexp":
        return _js_regex(str(option)).search(name) is not None
    if kind == "byFrameRefID":
        return ref_id == option
    raise ValueError(f"override matcher {kind!r} is not modelled (tests/e2e/grafana.py)")


def _set(config: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        config = config.setdefault(key, {})
    config[leaf] = value


def field_config(panel: dict, name: str, ref_id: str) -> dict:
    """The field config Grafana uses for one field (series or column) of the panel."""
    fc = panel.get("fieldConfig", {})
    config = copy.deepcopy(fc.get("defaults", {}))
    for override in fc.get("overrides", []):
        if _matches(override["matcher"], name, ref_id):
            for prop in override.get("properties", []):
                _set(config, prop["id"], copy.deepcopy(prop.get("value")))
    config.setdefault("color", {"mode": DEFAULT_COLOR_MODE.get(panel.get("type", ""), "thresholds")})
    config.setdefault("thresholds", copy.deepcopy(DEFAULT_THRESHOLDS))
    config.setdefault("mappings", [])
    return config


# ------------------------------------------------------------------------------------------- value -> colour

Value = float | str | bool | None


def js_string(value: Value) -> str:
    """String(value) in JavaScript, which value mappings compare against their keys."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value == int(value) and abs(value) < 1e21:
        return str(int(value))
    return repr(float(value))


def _number(value: Value) -> float:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def mapping_result(mappings: list[dict], value: Value) -> dict | None:
    """Grafana's getValueMappingResult: the first mapping that matches, in the order they are listed."""
    for m in mappings:
        kind, options = m.get("type"), m.get("options", {})
        if kind == "value":
            if value is not None and (hit := options.get(js_string(value))):
                return hit
        elif kind == "range":
            number = _number(value)
            if value is None or math.isnan(number):
                continue
            low, high = options.get("from"), options.get("to")
            if (low is not None and number < low) or (high is not None and number > high):
                continue
            return options.get("result")
        elif kind == "regex":
            if isinstance(value, str) and _js_regex(options.get("pattern", "")).search(value):
                return options.get("result")
        elif kind == "special":
            match = options.get("match")
            is_nan = isinstance(value, float) and math.isnan(value)
            if ((match == "null" and value is None) or (match == "nan" and is_nan)
                    or (match == "null+nan" and (value is None or is_nan))
                    or (match == "true" and value in (True, "true")) or (match == "false" and value in (False, "false"))
                    or (match == "empty" and value == "")):
                return options.get("result")
        else:
            raise ValueError(f"value mapping type {kind!r} is not modelled")
    return None


def threshold_colour(number: float, thresholds: dict, config: dict | None = None) -> str:
    """The colour of the last step whose value <= number (the base step's null = -inf); NaN: the base step."""
    steps = sorted(thresholds.get("steps") or DEFAULT_THRESHOLDS["steps"],
                   key=lambda s: -math.inf if s.get("value") is None else s["value"])
    if thresholds.get("mode") == "percentage" and not math.isnan(number):
        low, high = (config or {}).get("min"), (config or {}).get("max")
        if low is None or high is None:
            raise ValueError("percentage thresholds are modelled only with explicit min and max")
        number = (number - low) / (high - low) * 100 if high != low else 0.0
    active = steps[0]
    for step in steps:
        limit = -math.inf if step.get("value") is None else step["value"]
        if number >= limit:
            active = step
        else:
            break
    return active["color"]


def scale_colour(number: float, config: dict) -> str:
    mode = config.get("color", {}).get("mode", "thresholds")
    if mode == "thresholds":
        return threshold_colour(number, config.get("thresholds", DEFAULT_THRESHOLDS), config)
    if mode in ("fixed", "shades"):
        return config["color"].get("fixedColor", "")
    if mode.startswith("palette"):
        return "palette"
    return mode  # continuous-* gradients: not judged


@dataclass(frozen=True)
class Shown:
    text: str
    colour: str | None


def display(value: Value, config: dict) -> Shown:
    """Text and colour of one value (Grafana's display processor, without units and decimals)."""
    text: str | None = None
    colour: str | None = None
    mapped = mapping_result(config.get("mappings", []), value)
    if mapped:
        text = mapped.get("text")
        colour = mapped.get("color")
    number = _number(value)
    if not math.isnan(number) and text is None:
        text = js_string(number)
    if colour is None:
        colour = scale_colour(-math.inf if math.isnan(number) else number, config)
    if not text:
        text = config.get("noValue") or ("" if value is None else js_string(value))
    return Shown(text, colour)


# ------------------------------------------------------------------------------------------ whole panels

@dataclass(frozen=True)
class Series:
    ref_id: str
    name: str                  # display name: legend, or the table column
    labels: dict[str, str]
    value: float | None        # instant: the value; range: the last one that is a number (what "now" shows)
    text: str
    colour: str | None         # None: the panel does not colour this value (plain table cell, stat colorMode none)
    region: str | None = None  # timeseries with thresholdsStyle: the threshold band the last value sits in


@dataclass
class Panel:
    id: int
    title: str
    type: str
    series: list[Series] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)   # refIds whose query returned nothing
    no_value: str | None = None
    shown_when_empty: Shown | None = None             # what an empty panel shows

    def named(self, name: str) -> Series:
        found = [s for s in self.series if s.name == name]
        assert len(found) == 1, f"{self.title}: {len(found)} series named {name!r} in {[s.name for s in self.series]}"
        return found[0]

    def where(self, **labels: str) -> list[Series]:
        return [s for s in self.series if all(s.labels.get(k, "") == v for k, v in labels.items())]


Instant = Callable[[str], Iterable[tuple[dict[str, str], float]]]
Range = Callable[[str], Iterable[tuple[dict[str, str], list[float]]]]


def _last_number(values: list[float]) -> float:
    numbers = [v for v in values if not math.isnan(v)]
    return numbers[-1] if numbers else math.nan


def _value_column(panel: dict, ref_id: str) -> str:
    name = "Value" if len(panel.get("targets", [])) == 1 else f"Value #{ref_id}"
    for t in panel.get("transformations", []):
        if t.get("id") == "organize":
            name = t.get("options", {}).get("renameByName", {}).get(name, name) or name
    return name


def _colours_values(panel: dict, config: dict) -> bool:
    kind = panel.get("type")
    if kind == "stat":
        return panel.get("options", {}).get("colorMode", "value") != "none"
    if kind == "table":
        cell = config.get("custom", {}).get("cellOptions", {}).get("type") or config.get("custom", {}).get(
            "displayMode", "")
        return str(cell).startswith("color")
    return True


def render(panel: dict, variables: dict[str, str], instant: Instant, range_query: Range) -> Panel:
    """Run every target of the panel and work out what each series shows."""
    view = Panel(panel["id"], panel["title"], panel["type"],
                 no_value=panel.get("fieldConfig", {}).get("defaults", {}).get("noValue"))
    for target in panel.get("targets", []):
        if target.get("hide"):
            continue
        expr = interpolate(target["expr"], variables)
        ref = target["refId"]
        if target.get("instant") and not target.get("range"):
            rows = [(labels, value) for labels, value in instant(expr)]
        else:
            rows = [(labels, _last_number(values)) for labels, values in range_query(expr)]
        if not rows:
            view.empty.append(ref)
        for labels, number in rows:
            name = _value_column(panel, ref) if panel["type"] == "table" else legend(target.get("legendFormat"),
                                                                                     labels)
            config = field_config(panel, name, ref)
            shown = display(number, config)
            region = None
            style = config.get("custom", {}).get("thresholdsStyle", {}).get("mode", "off")
            if panel["type"] == "timeseries" and style != "off" and not math.isnan(number):
                region = threshold_colour(number, config["thresholds"], config)
            view.series.append(Series(ref, name, labels, number, shown.text,
                                      shown.colour if _colours_values(panel, config) else None, region))
    if not view.series:
        defaults = field_config(panel, "", "")
        shown = display(None, defaults)  # a null mapping's text, else noValue
        colour = shown.colour if panel["type"] in STAT_LIKE and _colours_values(panel, defaults) else None
        view.shown_when_empty = Shown(shown.text or "No data", colour)
    return view


def render_all(dashboard: dict, variables: dict[str, str], instant: Instant, range_query: Range) -> list[Panel]:
    return [render(p, variables, instant, range_query) for p in panels(dashboard)]
