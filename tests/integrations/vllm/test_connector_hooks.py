"""KvdConnector against the connector base class of the installed vLLM: every member of
KVConnectorBase_V1 is overridden by KvdConnector or left to the base class on purpose
(kvd.integrations.vllm.compat.INHERITED_HOOKS, each with its reason). Run once per
tested vLLM version (README: .venv-vllm for 0.32, .venv-vllm033 for 0.33); a version
kvd is not tested with is skipped here and refused at import."""

from __future__ import annotations

import inspect

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from kvd.integrations.vllm import VLLM_VERSION, KvdConnector, compat  # noqa: E402

pytestmark = pytest.mark.vllm


def _base():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1


def _hooks(cls: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls)
            if not (n.startswith("__") and n.endswith("__")) and n != "_abc_impl"}


@pytest.mark.parametrize("version", compat.TESTED_VLLM,
                         ids=[f"vllm-{a}.{b}" for a, b in compat.TESTED_VLLM])
def test_every_base_hook_is_implemented_or_inherited_on_purpose(version):
    if compat.major_minor(VLLM_VERSION) != version:
        pytest.skip(f"vLLM {VLLM_VERSION} installed; this case runs where "
                    f"{version[0]}.{version[1]} is")
    left = sorted(h for h in _hooks(_base()) - set(KvdConnector.__dict__)
                  if h not in compat.INHERITED_HOOKS)
    assert not left, (f"vLLM {VLLM_VERSION}'s KVConnectorBase_V1 has hooks KvdConnector "
                      f"neither implements nor lists in compat.INHERITED_HOOKS: {left}")
    assert not KvdConnector.__abstractmethods__
    missing = sorted(compat.HOOKS_BY_VERSION[version] - set(KvdConnector.__dict__))
    assert not missing, f"hooks vLLM {version} calls that KvdConnector lacks: {missing}"


def test_inherited_hooks_name_only_members_kvd_does_not_override():
    overridden = sorted(set(compat.INHERITED_HOOKS) & set(KvdConnector.__dict__))
    assert not overridden, f"listed as inherited but overridden: {overridden}"


def test_the_check_catches_a_hook_left_to_the_base_class():
    """The coverage check must see a missing hook: a connector that drops one."""
    class Partial(KvdConnector):
        pass

    del_name = "wait_for_save"
    own = set(KvdConnector.__dict__) - {del_name}
    left = sorted(h for h in _hooks(_base()) - own if h not in compat.INHERITED_HOOKS)
    assert left == [del_name]
    assert issubclass(Partial, _base())


def test_an_untested_vllm_version_is_refused_in_one_line(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(ImportError) as err:
        compat.check_vllm_version()
    assert "\n" not in str(err.value) and "found vLLM 0.31.2" in str(err.value)
