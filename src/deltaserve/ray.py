"""`deltaserve.ray:build`, the import path Ray Serve configs name: the replicas' frontend lives in
deltaserve/frontends/ray.py (a frontend like the server it runs); this name stays for the configs that say it."""

from deltaserve.frontends.ray import *  # noqa: F401,F403
from deltaserve.frontends.ray import build  # noqa: F401
