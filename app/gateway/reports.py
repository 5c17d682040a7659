"""Usage reports shared by the admin API, the team API and the CLI.

Whole-day ranges read the daily roll-up (a few rows per key and day, however many requests);
ranges with a time of day read the request rows. `since` is inclusive, `until` exclusive (UTC).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from sqlalchemy import SQLColumnExpression, case, func, select
from sqlalchemy.orm import Session

from app.gateway.usage import ABORTED, OK
from app.tables import NANO, ApiKey, Team, UsageDaily, UsageRow

GROUPS = ("day", "team", "key", "model", "replica")
SUMS = ("requests", "errors", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "cost_usd")


def parse_when(value: str | date | datetime | None) -> datetime | None:
    """ "2026-11-29" is that midnight UTC; datetimes with an offset are converted to naive UTC."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, date):
        return datetime.combine(value, time())
    else:
        text = value.strip().replace("Z", "+00:00")
        parsed = datetime.combine(date.fromisoformat(text), time()) if len(text) == 10 else datetime.fromisoformat(text)
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(UTC).replace(tzinfo=None)
    return parsed


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "15m", "1h", "2d" (a key rotation's grace, from the CLI or a form)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd]?)", text.strip().lower())
    if not match:
        raise ValueError(f"{text!r} is not a duration: use e.g. 3600, 90s, 15m, 1h or 2d")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def parse_group_by(value: str | Sequence[str] | None) -> tuple[str, ...]:
    parts = value.split(",") if isinstance(value, str) else list(value or ["day"])
    groups = tuple(dict.fromkeys(p.strip() for p in parts if p.strip()))
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise ValueError(f"group_by must be a comma-separated subset of {', '.join(GROUPS)}")
    return groups


def _whole_day(value: datetime | None) -> bool:
    return value is None or value.time() == time()


def usage_report(
    session: Session,
    *,
    group_by: Sequence[str] = ("day",),
    team_id: int | None = None,
    key_id: int | None = None,
    model: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int | None = None,
    offset: int = 0,
) -> list[dict[str, Any]]:
    table: type[UsageDaily] | type[UsageRow]
    day: SQLColumnExpression[date]
    requests: SQLColumnExpression[int]
    if "replica" not in group_by and _whole_day(since) and _whole_day(until):  # the roll-up has no replica
        table = UsageDaily
        day = UsageDaily.day
        errors = func.sum(UsageDaily.errors)
        requests = func.sum(UsageDaily.requests)
        filters = [UsageDaily.day >= since.date()] if since else []
        filters += [UsageDaily.day < until.date()] if until else []
    else:
        table = UsageRow
        day = func.date(UsageRow.created_at)
        errors = func.sum(case((UsageRow.status.in_((OK, ABORTED)), 0), else_=1))
        requests = func.count()
        filters = [UsageRow.created_at >= since] if since else []
        filters += [UsageRow.created_at < until] if until else []
    if team_id is not None:
        filters.append(table.team_id == team_id)
    if key_id is not None:
        filters.append(table.key_id == key_id)
    if model is not None:
        filters.append(table.model == model)
    columns = {
        "day": day,
        "team": table.team_id,
        "key": table.key_id,
        "model": table.model,
        "replica": UsageRow.replica,
    }
    keys = [columns[g].label(g) for g in group_by]
    query = (
        select(
            *keys,
            requests.label("requests"),
            errors.label("errors"),
            func.sum(table.prompt_tokens).label("prompt_tokens"),
            func.sum(table.cached_tokens).label("cached_tokens"),
            func.sum(table.completion_tokens).label("completion_tokens"),
            func.sum(table.cost_nano_usd).label("cost_nano_usd"),
        )
        .where(*filters)
        .group_by(*keys)
        .order_by(*keys)
        .offset(offset)
    )
    if limit is not None:
        query = query.limit(limit)
    rows = []
    for row in session.execute(query).mappings():
        out: dict[str, Any] = {}
        for g in group_by:
            value = row[g]
            if g == "day":
                out["day"] = value.isoformat() if isinstance(value, date) else str(value)[:10]
            else:
                out[{"team": "team_id", "key": "key_id"}.get(g, g)] = value
        out.update(
            requests=int(row["requests"] or 0),
            errors=int(row["errors"] or 0),
            prompt_tokens=int(row["prompt_tokens"] or 0),
            cached_tokens=int(row["cached_tokens"] or 0),
            completion_tokens=int(row["completion_tokens"] or 0),
        )
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        out["cost_usd"] = int(row["cost_nano_usd"] or 0) / NANO
        rows.append(out)
    _add_names(session, rows)
    return rows


def _add_names(session: Session, rows: list[dict[str, Any]]) -> None:
    team_ids = {r["team_id"] for r in rows if "team_id" in r}
    key_ids = {r["key_id"] for r in rows if "key_id" in r}
    teams = dict(session.execute(select(Team.id, Team.name).where(Team.id.in_(team_ids))).all()) if team_ids else {}
    keys = (
        dict(session.execute(select(ApiKey.id, ApiKey.key_prefix).where(ApiKey.id.in_(key_ids))).all())
        if key_ids
        else {}
    )
    for row in rows:
        if "team_id" in row:
            row["team_name"] = teams.get(row["team_id"])
        if "key_id" in row:
            row["key_prefix"] = keys.get(row["key_id"])


def list_requests(
    session: Session,
    *,
    team_id: int | None = None,
    key_id: int | None = None,
    model: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
    before: int | None = None,
) -> Sequence[UsageRow]:
    """Request rows, newest first, keyset-paginated by id."""
    query = select(UsageRow).order_by(UsageRow.id.desc()).limit(limit)
    for column, value in ((UsageRow.team_id, team_id), (UsageRow.key_id, key_id), (UsageRow.model, model)):
        if value is not None:
            query = query.where(column == value)
    if since is not None:
        query = query.where(UsageRow.created_at >= since)
    if until is not None:
        query = query.where(UsageRow.created_at < until)
    if before is not None:
        query = query.where(UsageRow.id < before)
    return session.scalars(query).all()


def report_columns(group_by: Sequence[str]) -> list[str]:
    names = {
        "day": ["day"],
        "team": ["team_id", "team_name"],
        "key": ["key_id", "key_prefix"],
        "model": ["model"],
        "replica": ["replica"],
    }
    return [c for g in group_by for c in names[g]] + list(SUMS)


# A cell starting with one of these is a formula to Excel, LibreOffice and Google Sheets
# (=HYPERLINK(...) in a team name); a leading apostrophe makes it text, as spreadsheets expect.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value: Any) -> Any:
    """Text as a spreadsheet shows it, never runs it; numbers are left alone."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_STARTS) else value


def to_csv(rows: Iterable[dict[str, Any]], group_by: Sequence[str]) -> str:
    buffer = io.StringIO()
    # CRLF rows (RFC 4180): the writer then quotes any cell holding a CR or LF, which a spreadsheet would
    # otherwise read as a row break, starting a new row with whatever follows ("\r=1+1" ran as =1+1).
    writer = csv.DictWriter(buffer, fieldnames=report_columns(group_by), extrasaction="ignore", lineterminator="\r\n")
    writer.writeheader()
    for row in rows:
        cells = {name: spreadsheet_safe(value) for name, value in row.items()}
        writer.writerow({**cells, "cost_usd": f"{row['cost_usd']:.9f}".rstrip("0").rstrip(".") or "0"})
    return buffer.getvalue()


def day_range(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time())
    return start, start + timedelta(days=1)
