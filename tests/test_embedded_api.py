"""The embedded Prefect API's start on a new PREFECT_HOME: the first server on a machine keeps its new, empty
database as a template; later servers on a new home start from it; a home's own database is never replaced."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from contextlib import closing

import pytest
from omniflow.flows.embedded_api import CACHE_DIR_ENV, DATABASE_URL_ENVS, DB_NAME, PrefectServer, template_database


def _api(url: str, path: str, body: dict) -> object:
    request = urllib.request.Request(
        f"{url}/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _flow_names(url: str) -> list[str]:
    return sorted(f["name"] for f in _api(url, "flows/filter", {}))


@pytest.mark.timeout(300)
def test_a_new_home_starts_from_the_template_and_an_existing_database_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    for name in DATABASE_URL_ENVS:
        monkeypatch.delenv(name, raising=False)
    template = template_database()
    assert template is not None and str(template).startswith(str(tmp_path / "cache"))

    first = PrefectServer(tmp_path / "first").start()
    try:
        first.wait_ready()
        assert not first.seeded and template.is_file()  # kept once the server answered
        _api(first.url, "flows/", {"name": "written-by-the-first-run"})  # after the copy: not in the template
        assert _flow_names(first.url) == ["written-by-the-first-run"]
    finally:
        first.stop()
    with closing(sqlite3.connect(template)) as db:
        assert db.execute("select count(*) from flow").fetchone() == (0,)
        assert db.execute("select count(*) from alembic_version").fetchone() == (1,)  # migrated

    second = PrefectServer(tmp_path / "second").start()
    try:
        assert second.seeded and (tmp_path / "second" / DB_NAME).is_file()
        second.wait_ready()
        assert _flow_names(second.url) == []
        _api(second.url, "flows/", {"name": "written-by-the-second-run"})
        assert _flow_names(second.url) == ["written-by-the-second-run"]
    finally:
        second.stop()

    again = PrefectServer(tmp_path / "first").start()  # a home with its database: used as it is
    try:
        assert not again.seeded
        again.wait_ready()
        assert _flow_names(again.url) == ["written-by-the-first-run"]
    finally:
        again.stop()


def test_no_template_when_the_database_is_not_the_homes_sqlite_file(monkeypatch):
    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://u:p@db:5432/prefect")
    assert template_database() is None
