"""The model registry without engines: registrations are checked (path, architecture, names) before
anything is written, a refused one leaves the registry as it was, and what is stored survives a restart;
on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import select

from app.db import make_engine, migrate, session_factory
from app.errors import OpenAIError
from app.gateway.audit import Actor
from app.observability.costs import HardwareCostMeter
from app.registry.inspection import inspect_source
from app.registry.pool import ModelPool
from app.registry.spec import RegistryError
from app.registry.store import RegistryStore
from app.tables import AuditEntry
from engine.config import EngineConfig

BASE = EngineConfig(num_kv_blocks=64)


def checkpoint(folder, model_type: str = "llama", weights: bool = True):
    """A folder that looks like a checkpoint to the registry (it reads config and file names only)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps({"model_type": model_type, "max_position_embeddings": 512, "hidden_act": "silu"})
    )
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture
def store(database_url):
    engine = make_engine(database_url)
    migrate(engine)
    yield RegistryStore(session_factory(engine))
    engine.dispose()


def run(coroutine):
    return asyncio.run(coroutine)


def register(store: RegistryStore, **fields):
    async def go():
        pool = ModelPool(BASE, store=store)
        await pool.start()
        return await pool.register(fields)

    return run(go())


def test_a_registration_is_stored_and_survives_a_restart(store, tmp_path):
    spec = register(
        store,
        name="tiny",
        path=str(checkpoint(tmp_path / "tiny")),
        aliases=["gpt-4o-mini"],
        price_input_per_1m=0.15,
        price_output_per_1m=0.6,
        engine_settings={"max_num_seqs": 8},
    )
    assert (spec.architecture, spec.max_model_len, spec.aliases) == ("llama", 512, ("gpt-4o-mini",))

    async def restarted():
        pool = ModelPool(BASE, store=store)
        await pool.start()
        return pool

    pool = run(restarted())
    found = pool.spec("gpt-4o-mini")
    assert found.name == "tiny" and found.engine_settings == {"max_num_seqs": 8}
    assert (found.price.input_per_1m, found.price.cached_input_per_1m, found.price.output_per_1m) == (0.15, 0.15, 0.6)
    assert pool.state("tiny") == "unloaded"


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"path": "/no/such/folder"}, "model_source_not_found"),
        ({"path": "relative/folder"}, "model_source_not_found"),
        ({"path": "GPT2"}, "unsupported_model"),  # an architecture the engine does not run
        ({"path": "NOWEIGHTS"}, "unsupported_model"),
        ({"path": "TINY", "kind": "embedding"}, "unsupported_model"),  # a Llama is not an encoder
        ({"path": "TINY", "engine_settings": {"warp_drive": True}}, "invalid_model"),
        ({"path": "TINY", "engine_settings": {"max_num_seqs": 0}}, "invalid_model"),
        ({"path": "TINY", "max_model_len": 4096}, "invalid_model"),  # beyond the checkpoint's 512 positions
        ({"path": "TINY", "name": "bad name!"}, "invalid_model"),
        ({"path": "TINY", "name": "existing"}, "conflict"),
        ({"path": "TINY", "aliases": ["existing-alias"]}, "conflict"),
    ],
)
def test_a_refused_registration_says_why_and_leaves_the_registry_unchanged(store, tmp_path, fields, code):
    register(store, name="existing", path=str(checkpoint(tmp_path / "existing")), aliases=["existing-alias"])
    before = store.all()
    paths = {
        "GPT2": checkpoint(tmp_path / "gpt2", "gpt2"),
        "NOWEIGHTS": checkpoint(tmp_path / "w", weights=False),
        "TINY": checkpoint(tmp_path / "tiny"),
    }
    fields = {"name": "new-model", **fields}
    fields["path"] = str(paths.get(fields["path"], fields["path"]))
    with pytest.raises(RegistryError) as refused:
        register(store, **fields)
    assert refused.value.code == code and str(refused.value)
    assert store.all() == before


def test_the_embedded_gguf_is_checked_from_its_header():
    facts = inspect_source("chat", "default")
    assert (facts.architecture, facts.max_context) == ("llama", 8192)


def test_a_model_that_is_not_loaded_or_disabled_answers_model_not_loaded(store, tmp_path):
    async def go():
        pool = ModelPool(BASE, store=store)
        await pool.start()
        await pool.register({"name": "tiny", "path": str(checkpoint(tmp_path / "tiny")), "aliases": ["small"]})
        errors = []
        for requested in ("small", "nope"):
            with pytest.raises(OpenAIError) as error:
                pool.resolve(requested)
            errors.append((error.value.status, error.value.code))
        await pool.update("tiny", {"enabled": False})
        with pytest.raises(OpenAIError) as disabled:
            pool.resolve("tiny")
        return errors, pool.state("tiny"), disabled.value.code

    errors, state, code = run(go())
    assert errors == [(503, "model_not_loaded"), (404, "model_not_found")]
    assert (state, code) == ("disabled", "model_not_loaded")


def test_changes_and_removal_are_stored(store, tmp_path):
    async def go():
        pool = ModelPool(BASE, store=store)
        await pool.start()
        await pool.register({"name": "tiny", "path": str(checkpoint(tmp_path / "tiny"))})
        await pool.register({"name": "other", "path": str(checkpoint(tmp_path / "other"))})
        await pool.update("tiny", {"aliases": ["a1", "a2"], "price_output_per_1m": 2.0})
        await pool.remove("other")

    run(go())
    [tiny] = store.all()
    assert (tiny.name, tiny.aliases, tiny.price.output_per_1m, tiny.price.input_per_1m) == (
        "tiny",
        ("a1", "a2"),
        2.0,
        0,
    )


def test_a_replica_picks_up_aliases_and_a_disable_made_on_another(store):
    from tests.support.gateway import FakeEngine

    async def go():
        here, there = ModelPool(BASE, store=store), ModelPool(BASE, store=store)
        here.add_loaded(FakeEngine(model_name="shared"))
        await here.start()
        await there.start()
        await there.update("shared", {"aliases": ["gpt-4o-mini"], "enabled": False})
        assert here.resolve("shared").name == "shared"  # until it reads the registry again
        await here.refresh()
        aliased = here.spec("gpt-4o-mini").name
        while here.state("shared") == "draining":
            await asyncio.sleep(0.01)
        return aliased, here.state("shared")

    assert run(go()) == ("shared", "disabled")


def test_the_server_hardware_cost_is_stored_and_read_by_every_pool(store):
    """Set on one replica (PATCH /admin/api/costs or the Models page): a pool started later, and one that
    was running already, use it; a negative or infinite one is refused and changes nothing."""

    async def go():
        running = ModelPool(BASE, store=store)
        running.cost_meter = HardwareCostMeter(2.0)  # TOKENMILL_HARDWARE_COST_PER_HOUR
        await running.start()
        setter = ModelPool(BASE, store=store)
        setter.cost_meter = HardwareCostMeter(2.0)
        await setter.start()
        await setter.set_server_hardware_cost(4.5)
        for bad in (-1.0, float("inf")):
            with pytest.raises(RegistryError) as refused:
                await setter.set_server_hardware_cost(bad)
            assert refused.value.param == "hardware_cost_per_hour"
        await running.refresh()
        restarted = ModelPool(BASE, store=store)
        restarted.cost_meter = HardwareCostMeter(2.0)
        await restarted.start()
        return running.server_hardware_cost, restarted.server_hardware_cost, restarted.hardware_cost_of("x")

    assert run(go()) == (4.5, 4.5, 4.5)


def test_setting_the_server_hardware_cost_is_audited_with_who_and_the_old_value(store):
    """The audit log names the admin and shows the cost before and after; a refused value leaves no row."""
    admin = Actor("admin_key", "1", "admin key")
    earlier = store.setting("hardware_cost_per_hour")  # a PostgreSQL database outlives one test
    first_before = None if earlier is None else {"hardware_cost_per_hour": earlier}

    async def go():
        pool = ModelPool(BASE, store=store)
        await pool.start()
        await pool.set_server_hardware_cost(1.5, actor=admin)
        await pool.set_server_hardware_cost(3.0, actor=admin)
        with pytest.raises(RegistryError):
            await pool.set_server_hardware_cost(-1.0, actor=admin)

    run(go())
    with store.sessions() as session:
        rows = list(
            session.scalars(select(AuditEntry).where(AuditEntry.target_type == "setting").order_by(AuditEntry.id))
        )
    assert [(row.action, row.actor_id, row.before, row.after) for row in rows] == [
        ("setting.update", "1", first_before, {"hardware_cost_per_hour": 1.5}),
        ("setting.update", "1", {"hardware_cost_per_hour": 1.5}, {"hardware_cost_per_hour": 3.0}),
    ]


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe"])
def test_the_families_the_engine_runs_are_accepted(tmp_path, model_type):
    facts = inspect_source("chat", str(checkpoint(tmp_path / model_type, model_type)))
    assert facts.architecture == model_type


def test_an_unsupported_architecture_is_named_with_what_is_supported(tmp_path):
    with pytest.raises(RegistryError) as refused:
        inspect_source("chat", str(checkpoint(tmp_path / "gpt2", "gpt2")))
    message = str(refused.value)
    assert "'gpt2'" in message and all(family in message for family in ("gemma3_text", "qwen3_moe", "phi3"))
