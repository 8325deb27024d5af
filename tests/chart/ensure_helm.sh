#!/usr/bin/env bash
# Build helm from its Go module into the test-bed tool cache, once, and print its path.
#
# The cache is shared with the control-plane test bed:
#   ${VLLMDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-dp-operator}/tools/helm-<version>/helm
# Only the Go module proxy is needed (no release tarball download), so this works offline
# from GitHub. A cold build takes a few minutes on 2 cores; later calls return at once.
set -euo pipefail

HELM_VERSION="${HELM_VERSION:-v3.22.0}"
cache="${VLLMDP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-dp-operator}"
dir="${cache}/tools/helm-${HELM_VERSION}"
bin="${dir}/helm"

if [[ ! -x "${bin}" ]]; then
    command -v go >/dev/null 2>&1 || { echo "ensure_helm: 'go' not found on PATH" >&2; exit 1; }
    mkdir -p "${dir}"
    # Build into a temporary directory and rename, so an interrupted build never leaves a
    # half-written binary that later runs would trust.
    tmp="$(mktemp -d "${dir}/.build.XXXXXX")"
    trap 'rm -rf "${tmp}"' EXIT
    echo "ensure_helm: building helm ${HELM_VERSION} from helm.sh/helm/v3 (first run only)" >&2
    GOBIN="${tmp}" CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -trimpath" \
        go install "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}" >&2
    mv -f "${tmp}/helm" "${bin}"
fi

echo "${bin}"
