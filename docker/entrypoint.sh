#!/bin/sh
# The container's entrypoint: print the image's versions, then `moe-overlay serve ARGS...`
# (a deployment YAML, e.g. /opt/moe-overlay/configs/kimi-k3-mi355x-tp8.yaml, and serve's options).
set -eu
versions="${MOE_OVERLAY_VERSIONS:-/opt/moe-overlay/versions.txt}"
echo "[moe-overlay] image versions ($versions):"
sed 's/^/[moe-overlay]   /' "$versions"
exec moe-overlay serve "$@"
