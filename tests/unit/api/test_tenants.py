"""The keys file (services/api/multitenancy/tenants.py): parsing, hashing, rotation by re-reading, and the policy's
decisions (services/api/multitenancy/tenancy.py `Tenancy.authorize`, `owns`)."""

from __future__ import annotations

import hashlib
import json
import os

import msgspec
import pytest

from services.api.errors import ApiError
from services.api.multitenancy.tenancy import Tenancy
from services.api.multitenancy.tenants import (
    MAX_DERIVING,
    OPEN,
    KeyCheckBusy,
    KeyFileError,
    KeyRing,
    Policy,
    SaltedHash,
    Tenant,
    parse_keys,
)
from shared.messages import SamplingParams, TokenizeJob
from shared.settings import ApiSettings

pytestmark = pytest.mark.timeout(30)

A_KEY, A_NEW_KEY, B_KEY, ADMIN_KEY, C_KEY = (f"sk-{name}-{'0' * 24}" for name in ("tenant-a-1", "tenant-a-2",
                                                                                "tenant-b-1", "admin-01", "tenant-c"))
LONG, OTHER = "sk-long-enough-" + "x" * 20, "sk-other-key-1-" + "x" * 20  # in the cases below as {LONG}, {OTHER}

YAML = f"""
- key: {A_KEY}
  tenant: team-a
  models: [rsinfer-demo]
  max_concurrent: 4
  requests_per_minute: 60
  tokens_per_minute: 10000
  priority: [0, 10]
  background: true
  weight: 3
- key_sha256: {hashlib.sha256(B_KEY.encode()).hexdigest()}
  tenant: team-b
- key: {ADMIN_KEY}
  tenant: ops
  admin: true
- key_hash: {SaltedHash.of(C_KEY, 100_000)}
  tenant: team-c
  max_concurrent: 1
"""


def test_yaml_entries_become_tenants_with_their_policies():
    table = parse_keys(YAML)
    keys = table.digests
    a = keys[hashlib.sha256(A_KEY.encode()).hexdigest()]
    assert a == Tenant("team-a", Policy(models=frozenset({"rsinfer-demo"}), max_concurrent=4, requests_per_minute=60,
                                        tokens_per_minute=10000, priority=(0, 10), background=True,
                                        weight=3))
    b = keys[hashlib.sha256(B_KEY.encode()).hexdigest()]
    assert b == Tenant("team-b", Policy()) and not b.policy.limited  # omitted limits mean none
    assert keys[hashlib.sha256(ADMIN_KEY.encode()).hexdigest()].admin
    [(salted, c)] = table.salted
    assert c == Tenant("team-c", Policy(max_concurrent=1)) and salted.matches(C_KEY.encode())
    assert not salted.matches(A_KEY.encode()) and salted.iterations == 100_000


def test_json_is_read_too_and_two_keys_of_one_tenant_agree():
    entry = {"tenant": "t", "max_concurrent": 2}
    text = json.dumps({"keys": [{"key": A_KEY, **entry}, {"key": A_NEW_KEY, **entry}]})
    assert {t.name for t in parse_keys(text).digests.values()} == {"t"}


@pytest.mark.parametrize(("text", "names"), [
    ("- {tenant: a}", "exactly one of `key`, `key_hash` and `key_sha256`"),
    (f"- {{key: {{LONG}}, key_sha256: {'0' * 64}, tenant: a}}", "exactly one of"),
    ("- {key: short, tenant: a}", "keys[0].key: a string of at least 32 characters"),
    ("- {key: sk-0123456789abcdef0123456789ab, tenant: a}", "keys[0].key: a string of at least 32"),
    ("- {key: {LONG}, tenant: default}", "keys[0].tenant: `default` is reserved"),
    ("- {key_hash: 'pbkdf2_sha256$1000$salt$" + "A" * 43 + "=', tenant: a}", "keys[0].key_hash"),
    ("- {key_hash: 'pbkdf2_sha256$600000$salt$AAAA', tenant: a}", "keys[0].key_hash"),
    ("- {key_hash: 'md5$600000$salt$" + "A" * 43 + "=', tenant: a}", "keys[0].key_hash"),
    ("- {key_hash: 'pbkdf2_sha256$600000$$" + "A" * 43 + "=', tenant: a}", "keys[0].key_hash"),
    ("- {key_hash: 'pbkdf2_sha256$x$salt$" + "A" * 43 + "=', tenant: a}", "keys[0].key_hash"),
    ("- {key_hash: 7, tenant: a}", "keys[0].key_hash"),
    ("- {key: {LONG}, tenant: 'a b'}", "keys[0].tenant"),
    ("- {key: {LONG}, tenant: a, max_concurent: 3}", "unknown field `max_concurent`"),
    ("- {key: {LONG}, tenant: a, max_concurrent: -1}", "keys[0].max_concurrent"),
    ("- {key: {LONG}, tenant: a, max_concurrent: true}", "keys[0].max_concurrent"),
    ("- {key: {LONG}, tenant: a, priority: [5, 1]}", "keys[0].priority"),
    ("- {key: {LONG}, tenant: a, background: 'yes'}", "keys[0].background"),
    ("- {key: {LONG}, tenant: a, models: rsinfer-demo}", "keys[0].models"),
    ("- {key: {LONG}, tenant: a}\n- {key: {LONG}, tenant: b}", "keys[1]: the same key"),
    ("- {key: {LONG}, tenant: a}\n- {key: {OTHER}, tenant: a, admin: true}", "another policy"),
    ("- {key: {LONG}, tenant: a, weight: 0}", "keys[0].weight"),
    ("- {key: {LONG}, tenant: a, weight: 1001}", "keys[0].weight"),
    ("- {key: {LONG}, tenant: a, weight: 1.5}", "keys[0].weight"),
    ("- {key: {LONG}, tenant: a, cache_salt: ''}", "keys[0].cache_salt"),
    ("- {key: {LONG}, tenant: a, cache_salt: 7}", "keys[0].cache_salt"),
    ("{key: {LONG}}", "a list of key entries"),
    ("- [unclosed", "not YAML or JSON"),
])
def test_a_bad_file_is_refused_naming_the_entry_and_field(text, names):
    with pytest.raises(KeyFileError, match=None) as e:
        parse_keys(text.replace("{LONG}", LONG).replace("{OTHER}", OTHER))
    assert names in str(e.value)


def test_keys_are_held_only_as_digests_and_matched_by_them(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(YAML)
    ring = KeyRing(str(path))
    assert ring.tenant(A_KEY).name == "team-a"
    assert ring.tenant(B_KEY.encode()).name == "team-b"  # given as its SHA-256 in the file
    assert ring.tenant("sk-unknown-key") is None and ring.tenant(None) is None and ring.tenant("") is None
    held = b"".join(ring.digests)
    for key in (A_KEY, B_KEY, ADMIN_KEY):
        assert key.encode() not in held and hashlib.sha256(key.encode()).digest() not in held
    assert all(len(d) == 32 for d in ring.digests)


def test_a_changed_file_is_reread_so_keys_rotate_and_a_removed_one_is_refused(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"- {{key: {A_KEY}, tenant: team-a}}\n")
    ring = KeyRing(str(path), check_s=1.0)
    assert ring.tenant(A_KEY).name == "team-a" and ring.tenant(A_NEW_KEY) is None
    path.write_text(f"- {{key: {A_KEY}, tenant: team-a}}\n- {{key: {A_NEW_KEY}, tenant: team-a}}\n")
    ring.checked_at -= 2  # the next look is due
    assert ring.tenant(A_NEW_KEY).name == "team-a" and ring.tenant(A_KEY).name == "team-a"  # both, while rotating
    path.write_text(f"- {{key: {A_NEW_KEY}, tenant: team-a}}\n")
    ring.checked_at -= 2
    assert ring.tenant(A_KEY) is None and ring.tenant(A_NEW_KEY).name == "team-a"


def test_a_file_broken_by_an_edit_keeps_the_keys_read_before(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"- {{key: {A_KEY}, tenant: team-a}}\n")
    ring = KeyRing(str(path))
    path.write_text("- {key: [")
    ring.checked_at -= 2
    assert ring.tenant(A_KEY).name == "team-a"


def test_a_bad_file_at_start_stops_the_start(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("- {tenant: a}")
    with pytest.raises(KeyFileError):
        KeyRing(str(path))
    with pytest.raises(KeyFileError, match="cannot read"):
        KeyRing(str(tmp_path / "missing.yaml"))


def test_no_key_is_open_mode_and_api_key_is_an_admin_tenant():
    assert KeyRing().tenant(None) is OPEN and not KeyRing().configured
    ring = KeyRing(api_key=ADMIN_KEY)
    assert ring.tenant(ADMIN_KEY).name == "default" and ring.tenant(ADMIN_KEY).admin and ring.tenant("x") is None


@pytest.mark.parametrize("key", ["k", "sk-" + "x" * 28, " " + "x" * 40])
def test_an_api_key_under_32_characters_stops_the_start(key):
    with pytest.raises(KeyFileError, match=r"--api-key .*at least 32 characters"):
        KeyRing(api_key=key)


async def test_a_salted_key_is_found_by_deriving_once_then_by_its_digest(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(YAML)
    ring = KeyRing(str(path))
    assert ring.tenant(C_KEY) is None  # not derived yet: `find` does it
    assert (await ring.find(C_KEY)).name == "team-c"
    assert ring.tenant(C_KEY).name == "team-c"  # remembered as a digest: no derivation again
    assert await ring.find("sk-not-a-key-" + "x" * 30) is None and (await ring.find(A_KEY)).name == "team-a"
    assert C_KEY.encode() not in b"".join(ring.digests)
    path.write_text(YAML.replace("team-c", "team-d"))  # a reload forgets what was derived against the old file
    ring.checked_at -= 2
    assert ring.tenant(C_KEY) is None and (await ring.find(C_KEY)).name == "team-d"
    ring.deriving = MAX_DERIVING  # that many unknown keys already wait: the next is turned away at once
    with pytest.raises(KeyCheckBusy):
        await ring.find("sk-another-unknown-key-" + "x" * 20)
    assert (await ring.find(A_KEY)).name == "team-a"  # a known key is never held up


def test_hash_key_writes_an_entry_that_matches_and_refuses_a_short_key(monkeypatch, capsys):
    import io

    from rsinfer.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(C_KEY + "\n"))
    assert main(["hash-key", "--iterations", "100000"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("key_hash: pbkdf2_sha256$100000$") and C_KEY not in line
    [(salted, _)] = parse_keys(f"- {{{line}, tenant: t}}").salted
    assert salted.matches(C_KEY.encode())
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-short\n"))
    assert main(["hash-key"]) == 2 and "at least 32 characters" in capsys.readouterr().err
    assert main(["hash-key", "--new", "--sha256"]) == 0
    key, digest = capsys.readouterr().out.splitlines()
    assert digest == "key_sha256: " + hashlib.sha256(key.removeprefix("key: ").encode()).hexdigest()
    assert len(key.removeprefix("key: ")) >= 32


def tenancy(tmp_path) -> Tenancy:
    path = tmp_path / "keys.yaml"
    path.write_text(YAML)
    return Tenancy(ApiSettings(redis_url="redis://127.0.0.1:1/0", api_keys_file=str(path)), None, None, None)


def test_the_policy_refuses_with_a_403_naming_the_field(tmp_path):
    t = tenancy(tmp_path)
    a, b = t.ring.tenant(A_KEY), t.ring.tenant(B_KEY)
    t.authorize(a, "rsinfer-demo", priority=10, background=True)
    refused = (({"model": "other"}, "model"), ({"priority": 11}, "priority"), ({"priority": -1}, "priority"))
    for kwargs, field in refused:
        with pytest.raises(ApiError) as e:
            t.authorize(a, **{"model": "rsinfer-demo", **kwargs})
        assert (e.value.status, e.value.param) == (403, field)
    t.authorize(b, "any-model", priority=-5)  # no range, every model
    with pytest.raises(ApiError) as e:
        t.authorize(b, "any-model", background=True)
    assert (e.value.status, e.value.param) == (403, "background")


def test_an_adapter_is_allowed_by_its_own_name_not_by_its_base(tmp_path):
    t = tenancy(tmp_path)
    a, b = t.ring.tenant(A_KEY), t.ring.tenant(B_KEY)  # a: rsinfer-demo only; b: every model
    for kwargs, field in (({"lora_path": "sql"}, "lora_path"), ({"model": "sql"}, "model")):
        with pytest.raises(ApiError) as e:
            t.authorize(a, **{"model": "rsinfer-demo", **kwargs})
        assert (e.value.status, e.value.param, e.value.code) == (403, field, "model_not_allowed")
    with pytest.raises(ApiError) as e:
        t.authorize_adapter(a, "sql", "lora_path")
    assert (e.value.status, e.value.param) == (403, "lora_path")
    t.authorize_adapter(a, None)  # no adapter: the base alone
    t.authorize(b, "rsinfer-demo", lora_path="sql")
    t.authorize_adapter(b, "sql")


def test_a_request_is_its_tenants_and_every_admins(tmp_path):
    t = tenancy(tmp_path)
    a, b, ops = t.ring.tenant(A_KEY), t.ring.tenant(B_KEY), t.ring.tenant(ADMIN_KEY)
    record = {"model": "m", **t.record_fields(a)}
    assert record["tenant"] == "team-a" and A_KEY not in json.dumps(record)
    assert t.owns(a, record) and t.owns(ops, record) and not t.owns(b, record)
    assert not t.owns(a, {"model": "m"})  # made in open mode: admins only
    assert t.needs_admin("/v1/load_lora_adapter") and not t.needs_admin("/metrics")


def test_jobs_carry_their_tenant_and_its_weight_for_fair_queueing(tmp_path):
    t = tenancy(tmp_path)
    job = TokenizeJob(uid="u", model="m", pod="p", created_at=0.0, deadline=1.0, params=SamplingParams(), prompt="x")
    [a] = t.stamp([job], t.ring.tenant(A_KEY))
    [b] = t.stamp([job], t.ring.tenant(B_KEY))
    assert (a.tenant, a.weight, b.tenant, b.weight) == ("team-a", 3, "team-b", 1)
    assert a.prompt == "x" and a.uid == "u"
    # a priority within the key's range whatever the job came with (team-a: [0, 10]; team-b: any)
    for asked, within in ((0, 0), (7, 7), (-3, 0), (1000, 10)):
        [a] = t.stamp([msgspec.structs.replace(job, priority=asked)], t.ring.tenant(A_KEY))
        [b] = t.stamp([msgspec.structs.replace(job, priority=asked)], t.ring.tenant(B_KEY))
        assert (a.priority, b.priority) == (within, asked)
    open_mode = Tenancy(ApiSettings(redis_url="redis://127.0.0.1:1/0"), None, None, None)
    assert open_mode.stamp([job], OPEN) == [job] and job.tenant == ""


def test_the_file_changes_are_seen_by_inode_too(tmp_path):
    """A mounted Secret is updated by swapping a symlink: same size and maybe the same mtime, another file."""
    old, new, link = tmp_path / "a", tmp_path / "b", tmp_path / "keys.yaml"
    old.write_text(f"- {{key: {A_KEY}, tenant: team-a}}\n")
    new.write_text(f"- {{key: {B_KEY}, tenant: team-a}}\n")
    os.utime(new, ns=(old.stat().st_atime_ns, old.stat().st_mtime_ns))
    link.symlink_to(old)
    ring = KeyRing(str(link))
    tmp = tmp_path / "tmp-link"
    tmp.symlink_to(new)
    os.replace(tmp, link)
    ring.checked_at -= 2
    assert ring.tenant(B_KEY).name == "team-a" and ring.tenant(A_KEY) is None


def test_a_policy_may_share_its_prefix_cache_scope_and_a_tenant_has_its_own_by_default():
    table = parse_keys(json.dumps([{"key": A_KEY, "tenant": "a", "cache_salt": "docs"},
                                   {"key": B_KEY, "tenant": "b", "cache_salt": "docs"},
                                   {"key": C_KEY, "tenant": "docs"}, {"key": ADMIN_KEY, "tenant": "ops"}]))
    scopes = {t.name: t.cache_scope for t in table.digests.values()}
    assert scopes["a"] == scopes["b"] == "salt:docs"
    assert scopes["docs"] == "tenant:docs" and scopes["ops"] == "tenant:ops", "a salt never names a tenant's own scope"
    assert OPEN.cache_scope == ""
