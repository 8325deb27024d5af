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
    # `go install` skips the ldflags of helm's release build (its Makefile): stamp the version,
    # and the Kubernetes version that `helm template`/`lint` assume without a cluster (taken,
    # as upstream does, from the k8s.io/client-go minor version helm is built with; unset it
    # is v1.20, which fails the chart's kubeVersion constraint).
    gomod="$(go mod download -json "helm.sh/helm/v3@${HELM_VERSION}" \
        | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
    k8s_minor="$(sed -n 's/^[[:space:]]*k8s\.io\/client-go v0\.\([0-9][0-9]*\)\..*/\1/p' "${gomod}")"
    [[ -n "${k8s_minor}" ]] || { echo "ensure_helm: no k8s.io/client-go in ${gomod}" >&2; exit 1; }
    ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
    for pkg in pkg/chartutil pkg/lint/rules; do
        ldflags+=" -X helm.sh/helm/v3/${pkg}.k8sVersionMajor=1"
        ldflags+=" -X helm.sh/helm/v3/${pkg}.k8sVersionMinor=${k8s_minor}"
    done
    GOBIN="${tmp}" CGO_ENABLED=0 go install -trimpath -ldflags "${ldflags}" \
        "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}" >&2
    mv -f "${tmp}/helm" "${bin}"
fi

echo "${bin}"
