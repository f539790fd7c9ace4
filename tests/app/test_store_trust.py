"""The result store as a trust boundary: rows authenticated by an HMAC under QKOV_STORE_SECRET (a planted or moved
row is recomputed, a second process with the same secret reads the first one's rows), and no file name read from a
cache.db row is ever read or deleted unless diskcache made it. Without the secret rows are still authenticated: a
disk store under a key drawn once and kept beside its folder (shared by a machine's processes), and a Redis store is
not used at all."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import diskcache

from app.observability import open_store_tier
from app.settings import Settings
from app.store import KEY_PREFIX, DiskStore, RedisStore, StoreTier, compress, key_file

SECRET = b"s" * 32


def _tier(folder: Path, secret: bytes | None = SECRET) -> StoreTier:
    return StoreTier(DiskStore(folder, 2**24), claim_ttl_s=5, code="test", secret=secret)


def test_rows_are_read_back_only_under_the_same_secret(tmp_path):
    writer = _tier(tmp_path)
    asyncio.run(writer.put("page-a", b"<p>honest</p>"))
    assert asyncio.run(_tier(tmp_path).get("page-a")) == b"<p>honest</p>"  # another process, same secret
    other = _tier(tmp_path, secret=b"t" * 32)
    assert asyncio.run(other.get("page-a")) is None and other.rejected == 1


def test_a_planted_or_moved_row_is_recomputed(tmp_path):
    tier = _tier(tmp_path)
    asyncio.run(tier.put("page-a", b"<p>honest</p>"))
    asyncio.run(tier.put("page-b", b"<p>other</p>"))
    raw = tier.store
    # whoever can write the store (no secret): a page with script, in the format rows have without a MAC
    raw.put(tier._key("page-a"), b"<script>alert(1)</script>")
    assert asyncio.run(tier.get("page-a")) is None
    # a genuine row moved under another key fails too (the MAC covers the key)
    raw.put(tier._key("page-c"), raw.get(tier._key("page-b")))  # type: ignore[arg-type]
    assert asyncio.run(tier.get("page-c")) is None
    assert asyncio.run(tier.get("page-b")) == b"<p>other</p>" and tier.rejected == 2
    assert tier.status()["authenticated"] is True and tier.status()["rejected_rows"] == 2


def test_a_row_naming_a_file_outside_the_store_is_neither_read_nor_deleted(tmp_path):
    store_dir, victim = tmp_path / "store", tmp_path / "outside" / "secret.txt"
    victim.parent.mkdir()
    victim.write_bytes(compress(b"not the store's"))
    store = DiskStore(store_dir, 2**24)
    store.put("k", b"x" * 100)
    store.close()
    with sqlite3.connect(store_dir / "cache.db") as db:
        db.execute(
            "UPDATE Cache SET mode = ?, filename = ?, value = NULL WHERE key = ?",
            (diskcache.core.MODE_BINARY, str(victim), KEY_PREFIX + "k"),
        )
    again = DiskStore(store_dir, 2**24)
    assert again.get("k") is None  # refused, and the row dropped
    assert victim.read_bytes() == compress(b"not the store's") and victim.parent.is_dir()


def test_without_a_secret_a_planted_row_is_recomputed_and_the_key_stays_outside_the_store(tmp_path):
    settings = Settings(store_url="disk", store_dir=tmp_path / "store", store_secret=None)
    tier, problem = open_store_tier(settings)
    assert tier is not None and problem is None
    key = "page|/models/toy-2l"
    # whoever can write the store folder, in the format rows had without a secret: not served
    tier.store.put(tier._key(key), b"<script>alert(1)</script>")
    assert asyncio.run(tier.get(key)) is None and tier.rejected == 1
    asyncio.run(tier.put(key, b"<p>honest</p>"))
    again, _ = open_store_tier(settings)  # another worker of this machine, or a restart: the same key file
    assert again is not None and asyncio.run(again.get(key)) == b"<p>honest</p>"
    status = again.status()
    assert status["authenticated"] is True and status["key"] == "key file store.key"
    path = key_file(settings.store_dir)
    assert path.parent == tmp_path and len(path.read_bytes()) == 32 and path.stat().st_mode & 0o077 == 0
    assert not any(p.name == path.name for p in settings.store_dir.rglob("*"))  # never kept in the store
    assert path.read_bytes() not in b"".join(p.read_bytes() for p in settings.store_dir.rglob("*") if p.is_file())


def test_without_a_secret_redis_is_not_used_and_readyz_says_why(tmp_path):
    settings = Settings(store_url="redis://127.0.0.1:1/0", store_dir=tmp_path / "store", store_secret=None)
    tier, _ = open_store_tier(settings)
    assert tier is not None and isinstance(tier.store, DiskStore)
    assert "QKOV_STORE_SECRET is unset" in tier.status()["note"]
    shared = Settings(store_url="redis://127.0.0.1:1/0", store_dir=tmp_path / "store", store_secret="x" * 32)
    tier, _ = open_store_tier(shared)
    assert tier is not None and isinstance(tier.store, RedisStore) and tier.status()["key"] == "secret"


def test_a_key_file_that_cannot_be_read_means_running_without_the_store(tmp_path):
    settings = Settings(store_url="disk", store_dir=tmp_path / "store", store_secret=None)
    key_file(settings.store_dir).write_bytes(b"short")  # not a key: never guessed around
    tier, problem = open_store_tier(settings)
    assert tier is None and problem is not None and problem["ok"] is False
    assert "store.key holds 5 bytes" in problem["detail"]
