# Take a lock and write through fence-proxy: LOCKD_ENDPOINTS=host:port,... FENCE_PROXY_URL=http://...
import os, requests
from lockd_client import Client, FenceAuth

client = Client(os.environ.get("LOCKD_ENDPOINTS", "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003"))
with client.lock("orders/42", ttl=30, wait=10) as lease:
    proxy = os.environ.get("FENCE_PROXY_URL", "http://127.0.0.1:8080")
    # FenceAuth checks the lease, then adds Lock-Resource, Fencing-Token and Lock-Sequencer.
    reply = requests.put(proxy + "/orders/42", json={"status": "paid"}, auth=FenceAuth(lease))
    reply.raise_for_status()
    print("written with fencing token", lease.fencing_token)
