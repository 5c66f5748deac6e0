"""The README's snippets that a reader copies run as written, against a real data plane."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from test_serve_process import serve_process
from tritonclient.utils import InferenceServerException

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(first_line: str) -> str:
    """The README's fenced block that starts with ``first_line``."""
    blocks = re.findall(r"```\w*\n(.*?)```", README.read_text(), re.S)
    (found,) = [block for block in blocks if block.startswith(first_line)]
    return str(found)


def test_the_token_snippet_loads_and_unloads_over_grpc_and_http(tmp_path: Path) -> None:
    code = snippet("# load and unload with the token")
    with serve_process(tmp_path) as plane:
        token_file = tmp_path / "serve-token"  # agent_process.agent_config's
        ran = (code.replace('"/etc/edge-agent/serve-token"', repr(str(token_file)))
               .replace('"localhost:8001"', repr(plane["grpc"]))
               .replace('"localhost:8000"', repr(plane["http"])))
        assert ran.count(str(token_file)) == 1 and plane["grpc"] in ran and plane["http"] in ran
        exec(compile(ran, "README.md", "exec"), {})  # the README's own code
        client = grpcclient.InferenceServerClient(plane["grpc"])
        assert client.is_model_ready("demo")  # unloaded, then loaded again
        # what the README warns of: gRPC refuses an upper-case metadata key
        token = token_file.read_text().strip()
        with pytest.raises(InferenceServerException, match="Invalid metadata"):
            client.unload_model("demo", headers={"Authorization": f"Bearer {token}"})
        assert client.is_model_ready("demo")
        client.close()
