"""`tokenmill teams|keys|usage`: the admin API's jobs from a shell, against the same database.

Settings come from the environment (TOKENMILL_DATABASE_URL, TOKENMILL_DATA_DIR) or --database-url /
--data-dir. Migrations run first, so the commands work on an empty database too. Changes go into the
audit log as made by the CLI, under the OS user who ran it.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import socket
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from app.db import make_engine, migrate, session_factory
from app.gateway import crud
from app.gateway.audit import Actor
from app.gateway.reports import parse_duration, parse_group_by, parse_when, report_columns, to_csv, usage_report

if TYPE_CHECKING:
    from typing import TextIO

    from sqlalchemy import Engine
    from sqlalchemy.orm import Session, sessionmaker

    from app.tables import ApiKey, Team


def _open(args: argparse.Namespace) -> tuple[Engine, sessionmaker[Session]]:
    from app.data_dir import make_private
    from app.settings import settings_from

    settings = settings_from({"database_url": args.database_url, "data_dir": args.data_dir}, os.environ)
    make_private(settings.data_dir)  # the first command may create the SQLite database there
    engine = make_engine(settings.database_url)
    migrate(engine)
    return engine, session_factory(engine)


def cli_actor() -> Actor:
    """Whoever ran the command, as well as the machine can say (the CLI holds no admin credential: it
    reaches the database directly)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        user = f"uid {os.getuid()}"
    return Actor("cli", user, f"{user}@{socket.gethostname()}")


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", default=None, help="SQLAlchemy URL [env TOKENMILL_DATABASE_URL]")
    parser.add_argument("--data-dir", default=None, help="folder of the default SQLite file [env TOKENMILL_DATA_DIR]")


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=None, help="comma-separated allowed models (default: all)")
    parser.add_argument("--rpm", type=int, default=None, help="requests per minute")
    parser.add_argument("--tpm", type=int, default=None, help="tokens per minute")
    parser.add_argument("--budget", type=float, default=None, help="max spend in USD per period")
    parser.add_argument("--period", choices=("day", "month"), default=None, help="budget period (default month)")
    parser.add_argument("--expires", default=None, help="ISO date / time (UTC), or +30d / +12h")


def parse_expiry(text: str | None) -> datetime | None:
    if not text:
        return None
    match = re.fullmatch(r"\+(\d+)([dhm])", text.strip())
    if match:
        amount, unit = int(match[1]), match[2]
        delta = {"d": timedelta(days=amount), "h": timedelta(hours=amount), "m": timedelta(minutes=amount)}[unit]
        return datetime.now(UTC).replace(tzinfo=None) + delta
    return parse_when(text)


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    limits = {
        "rpm_limit": args.rpm,
        "tpm_limit": args.tpm,
        "max_budget_usd": args.budget,
        "budget_period": args.period,
        "expires_at": parse_expiry(args.expires),
    }
    if args.models is not None:
        limits["allowed_models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    return {k: v for k, v in limits.items() if v is not None}


def _table(rows: list[dict[str, Any]], columns: list[str], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    cells = [[("" if row.get(c) is None else str(row.get(c))) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=out)
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)), file=out)


def _fail(message: str) -> int:
    print(f"tokenmill: {message}", file=sys.stderr)
    return 1


def _team_named(session: Session, name: str) -> Team:
    team = crud.get_team_by_name(session, name=name)
    if team is None:
        raise LookupError(f"no team named {name!r}")
    return team


# teams


def teams_create(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    with sessions() as session:
        try:
            share = {
                "scheduling_weight": args.weight,
                "cache_group": args.cache_group,
                "file_quota_bytes": args.file_quota_bytes,
            }
            team = crud.create_team(
                session,
                actor=cli_actor(),
                name=args.name,
                **_limits(args),
                **{k: v for k, v in share.items() if v is not None},
            )
        except (crud.Conflict, ValueError) as error:
            return _fail(str(error))
        session.commit()
        print(f"created team {team.name!r} (id {team.id})")
    return 0


def teams_list(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    rows, after = [], None
    with sessions() as session:
        while True:
            page = crud.list_teams(session, limit=1000, after=after)
            rows += [
                {
                    "id": t.id,
                    "name": t.name,
                    "models": ",".join(t.allowed_models) or "*",
                    "rpm": t.rpm_limit,
                    "tpm": t.tpm_limit,
                    "budget_usd": t.max_budget_usd,
                    "period": t.budget_period,
                }
                for t in page
            ]
            if len(page) < 1000:
                break
            after = page[-1].id
    _table(rows, ["id", "name", "models", "rpm", "tpm", "budget_usd", "period"])
    return 0


# keys


def keys_create(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    with sessions() as session:
        try:
            team = _team_named(session, args.team)
            key, plaintext = crud.create_key(
                session, actor=cli_actor(), team=team, name=args.name or "", **_limits(args)
            )
        except (LookupError, ValueError) as error:
            return _fail(str(error))
        session.commit()
        print(
            f"created key {key.key_prefix}... (id {key.id}) for team {team.name!r}; shown once, store it now:",
            file=sys.stderr,
        )
        print(plaintext)
    return 0


def keys_list(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    rows, after = [], None
    with sessions() as session:
        try:
            team_id = _team_named(session, args.team).id if args.team else None
        except LookupError as error:
            return _fail(str(error))
        names = {t.id: t.name for t in crud.list_teams(session, limit=100_000)}
        while True:
            page = crud.list_keys(session, team_id=team_id, include_revoked=args.all, limit=1000, after=after)
            rows += [
                {
                    "id": k.id,
                    "prefix": k.key_prefix,
                    "team": names.get(k.team_id, k.team_id),
                    "name": k.name,
                    "expires": k.expires_at,
                    "revoked": "yes" if k.revoked_at else "",
                    "last_used": k.last_used_at,
                }
                for k in page
            ]
            if len(page) < 1000:
                break
            after = page[-1].id
    _table(rows, ["id", "prefix", "team", "name", "expires", "revoked", "last_used"])
    return 0


def _one_key(session: Session, ident: str) -> ApiKey:
    """The key `ident` names: its id, or its visible prefix as `keys list` shows it."""
    from sqlalchemy import select

    from app.tables import ApiKey

    if ident.isdigit():
        keys = [k for k in [crud.get_key(session, key_id=int(ident))] if k is not None]
    else:
        keys = list(session.scalars(select(ApiKey).where(ApiKey.key_prefix == ident)))
    if len(keys) != 1:
        raise LookupError(f"{'no' if not keys else 'more than one'} key matches {ident!r}")
    return keys[0]


def keys_revoke(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    with sessions() as session:
        try:
            key = _one_key(session, args.key)
        except LookupError as error:
            return _fail(str(error))
        crud.revoke_key(session, actor=cli_actor(), key=key)
        session.commit()
        print(f"revoked key {key.key_prefix}... (id {key.id}); replicas drop it within their cache TTL")
    return 0


def keys_rotate(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    with sessions() as session:
        try:
            key = _one_key(session, args.key)
            old_prefix = key.key_prefix
            key, plaintext, _ = crud.rotate_key(
                session, actor=cli_actor(), key=key, grace_period_s=parse_duration(args.grace)
            )
        except (LookupError, ValueError, crud.Conflict) as error:
            return _fail(str(error))
        session.commit()
        print(
            f"rotated key {key.key_prefix}... (id {key.id}); the old secret {old_prefix}... works until "
            f"{key.previous_key_expires_at:%Y-%m-%d %H:%M:%S} UTC. The new one is shown once, store it now:",
            file=sys.stderr,
        )
        print(plaintext)
    return 0


# usage


def usage(args: argparse.Namespace) -> int:
    _, sessions = _open(args)
    try:
        group_by = parse_group_by(args.group_by)
        since, until = parse_when(args.since), parse_when(args.until)
    except ValueError as error:
        return _fail(str(error))
    with sessions() as session:
        team_id = None
        if args.team:
            try:
                team_id = _team_named(session, args.team).id
            except LookupError as error:
                return _fail(str(error))
        rows = usage_report(session, group_by=group_by, team_id=team_id, model=args.model, since=since, until=until)
    if args.csv:
        sys.stdout.write(to_csv(rows, group_by))
    else:
        _table(rows, report_columns(group_by))
    return 0


def _teams_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a team")
    create.add_argument("name")
    create.add_argument(
        "--weight", type=float, default=None, help="share of the engine against other teams (default 1)"
    )
    create.add_argument("--cache-group", default=None, help="teams in one group reuse each other's cached prompts")
    create.add_argument(
        "--file-quota-bytes", type=int, default=None, help="bytes its files may take (default: the server's)"
    )
    _limit_arguments(create)
    _store_arguments(create)
    create.set_defaults(run=teams_create)
    listing = sub.add_parser("list", help="list teams")
    _store_arguments(listing)
    listing.set_defaults(run=teams_list)


def _keys_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a key for a team (printed once)")
    create.add_argument("--team", required=True, help="team name")
    create.add_argument("--name", default="", help="what the key is for")
    _limit_arguments(create)
    _store_arguments(create)
    create.set_defaults(run=keys_create)
    listing = sub.add_parser("list", help="list keys (prefixes only)")
    listing.add_argument("--team", default=None, help="only this team's keys")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    _store_arguments(listing)
    listing.set_defaults(run=keys_list)
    revoke = sub.add_parser("revoke", help="revoke a key by id or visible prefix")
    revoke.add_argument("key", help="key id, or its prefix as `keys list` shows it")
    _store_arguments(revoke)
    revoke.set_defaults(run=keys_revoke)
    rotate = sub.add_parser("rotate", help="a new secret for a key (printed once); the old one works for --grace")
    rotate.add_argument("key", help="key id, or its prefix as `keys list` shows it")
    rotate.add_argument("--grace", default="24h", help="how long the old secret keeps working: 0, 90s, 15m, 1h, 2d")
    _store_arguments(rotate)
    rotate.set_defaults(run=keys_rotate)


def _usage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--team", default=None, help="team name (default: all teams)")
    parser.add_argument("--since", required=True, help="inclusive date or ISO time, UTC")
    parser.add_argument("--until", default=None, help="exclusive date or ISO time, UTC")
    parser.add_argument("--model", default=None)
    parser.add_argument("--group-by", default="day", help="comma-separated: day, team, key, model")
    parser.add_argument("--csv", action="store_true", help="CSV instead of a table")
    _store_arguments(parser)


def _dispatch(args: argparse.Namespace) -> int:
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


def commands() -> list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]]:
    """(name, help, add_arguments, run) for app.cli.main's COMMANDS."""
    return [
        ("teams", "create and list teams", _teams_arguments, _dispatch),
        ("keys", "create, list, rotate and revoke API keys", _keys_arguments, _dispatch),
        ("usage", "usage report (table or CSV)", _usage_arguments, usage),
    ]
