#!/bin/sh
# Entry point of the ddtree-serve image.
#   gateway|verifier|drafter [FLAGS...]  start that service on its port (50051|50053|50052) with the
#                                        checkpoints named by DDTREE_TARGET / DDTREE_DRAFTER; FLAGS are
#                                        passed on (a repeated flag overrides the one set here)
#   init                                 the preflight (docker/preflight.py): check the checkpoints and the
#                                        settings, print every problem, exit 1 on any; with DDTREE_TINY_MODEL=1
#                                        it first writes the tiny model into $DDTREE_MODELS unless a target is there
#   anything else                        run as a command (`ddtree offline ...`, `python ...`)
set -eu
here=$(dirname "$0")
models=${DDTREE_MODELS:-/models}
target=${DDTREE_TARGET:-$models/target}
drafter=${DDTREE_DRAFTER:-$models/dflash}
role=${1:-}
[ $# -gt 0 ] && shift

case "$role" in
  gateway)
    exec python -m gateway.server --listen 0.0.0.0:50051 --tokenizer "$target" \
      --verifiers "${DDTREE_VERIFIERS:-verifier:50053}" "$@" ;;
  verifier)
    exec python -m verifier_service.server --listen 0.0.0.0:50053 --target "$target" \
      --drafters "${DDTREE_DRAFTERS-dns:///drafter:50052}" "$@" ;;
  drafter)
    exec python -m drafter_service.server --listen 0.0.0.0:50052 --drafter "$drafter" --target "$target" "$@" ;;
  init)
    if [ "${DDTREE_TINY_MODEL:-0}" = 1 ] && [ "$target" = "$models/target" ] && [ ! -f "$target/config.json" ]; then
      ddtree make-tiny-model "$models"
    fi
    exec python "$here/preflight.py" --target "$target" --drafter "$drafter" "$@" ;;
  *)
    exec "$role" "$@" ;;
esac
