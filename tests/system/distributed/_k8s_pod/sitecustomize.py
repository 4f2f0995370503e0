"""Test-only: a process here plays a Kubernetes pod (test_engines.py puts this folder on
PYTHONPATH). Its own FQDN is the pod's (JDP_TEST_POD_FQDN, as kubelet's /etc/hosts gives
it) and every name in the pods' subdomain (JDP_TEST_POD_DOMAIN, e.g. mnist-0.mnist) resolves
to 127.0.0.1, except for the first JDP_TEST_DNS_MISSES lookups in this process (a record
published late)."""
import os
import socket

_FQDN = os.environ.get("JDP_TEST_POD_FQDN")
if _FQDN:
    _SUBDOMAIN = "." + os.environ["JDP_TEST_POD_DOMAIN"] + "."
    _misses = [int(os.environ.get("JDP_TEST_DNS_MISSES", "0"))]
    _real_getaddrinfo, _real_getfqdn = socket.getaddrinfo, socket.getfqdn

    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if isinstance(name, str) and _SUBDOMAIN in name + ".":
            if _misses[0] > 0:
                _misses[0] -= 1
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            host = "127.0.0.1"
        return _real_getaddrinfo(host, *args, **kwargs)

    def getfqdn(name=""):
        return _FQDN if name in ("", _FQDN.split(".")[0]) else _real_getfqdn(name)

    socket.getaddrinfo, socket.getfqdn = getaddrinfo, getfqdn
