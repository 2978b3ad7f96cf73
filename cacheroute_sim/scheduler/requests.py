"""The Scheduler-shaped request (the body a CacheRoute Scheduler POSTs to a proxy), as tests,
benchmarks and the demo send it."""

from __future__ import annotations

import copy
from typing import Any


SCHEDULER_BODY: dict[str, Any] = {  # read only: scheduler_body() gives a copy to change
    "Request_ID": 0, "Request_type": "request",
    "Prompt": {"model": "llama3-70b", "user_prompt": "Who wrote X?", "token_length": 42, "bs": 1,
               "max_tokens": 4, "stream": True, "temperature": 0.7, "top_p": 0.95},
    "Service": {"Enable_PD_Disaggregation": True, "Enable_know_injection": False,
                "Injection_type": "text", "Enable_compress": False, "Compress_factor": 0.3,
                "Enable_security": False, "Knowledge_block_num": 0, "Knowledge_List": [],
                "Knowledge_length": 0, "SLO_TTFT": 15000, "SLO_E2E": 215000, "SLO_TPOT": 200,
                "Endpoint_type": "chat/completions"},
    "Task": {"User_addr": "127.0.0.1", "KDN_server_addr": "", "default_know_addr": "",
             "P_proxy_id": "hp_127.0.0.1:8001", "P_proxy_addr": "127.0.0.1", "P_proxy_port": 8001,
             "D_proxy_addr": "", "D_proxy_port": 0, "prefill_instance": "0", "decode_instance": "",
             "batch_order": 0, "User_url_path": "/v1/chat/completions"},
}


def scheduler_body(request_id: int, **prompt: Any) -> dict[str, Any]:
    """A fresh copy of SCHEDULER_BODY with this `Request_ID` and these `Prompt` fields set
    (e.g. `stream=False`)."""
    body = copy.deepcopy(SCHEDULER_BODY)
    body["Request_ID"] = request_id
    body["Prompt"].update(prompt)
    return body


