"""A pytest plugin: ``--dist loadgroup`` sends the tests of one ``xdist_group`` to one worker again.

pytest-xdist's worker marks a grouped test by suffixing its id with ``@group`` through ``item._nodeid``,
which pytest 9.2 no longer reads (an item keeps its id in ``_id``): the groups were silently ignored, a
group's tests spread over both workers, and each worker set up the module fixtures the group shares
(tests/rollout/test_vllm.py's vLLM servers) again. This writes the suffix where pytest reads it, and is a
no-op wherever xdist's own suffix took. tests/test_xdist_groups.py checks a group runs on one worker.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # xdist sets it on its workers under --dist loadgroup
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)
