"""Every built-in transport usable on this machine against the one contract suite.

The suite lives in ``stratagem.testing.contract`` so that third-party transports run the very same
tests; here one test class is made per registered built-in transport.
"""

from stratagem.plugins.manager import plugin_manager
from stratagem.testing import run_contract

for _info in plugin_manager().describe(check=True):
    if _info.kind == "transport" and _info.source == "builtin" and _info.usable:
        globals()[f"TestContract_{_info.name}"] = run_contract(_info.name)


def test_the_built_in_transports_are_all_under_contract():
    names = {name[len("TestContract_"):] for name in globals() if name.startswith("TestContract_")}
    assert {"local", "zmq"} <= names
