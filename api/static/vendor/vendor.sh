#!/usr/bin/env bash
# Re-vendor uPlot (the dashboard's chart library) from npm. Not part of set-up: the vendored files are
# committed, so the dashboard works offline and installs need no Node. Run this only to change the pin.
#   api/static/vendor/vendor.sh            # re-fetch the pinned version and verify its integrity
#   UPLOT_VERSION=1.6.33 UPLOT_SHA256= api/static/vendor/vendor.sh   # move the pin (prints the new sha256)
set -euo pipefail
cd "$(dirname "$0")"
VERSION="${UPLOT_VERSION:-1.6.32}"
SHA256="${UPLOT_SHA256-4b8a8191e425658e3ea8c8c1314b0fc679c861ee3a1af2b20c7b16ba50b5133d}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "uplot@$VERSION" >/dev/null)
tgz="$tmp/uplot-$VERSION.tgz"
got="$(sha256sum "$tgz" | cut -d' ' -f1)"
if [ -n "$SHA256" ] && [ "$got" != "$SHA256" ]; then
  echo "uplot-$VERSION.tgz sha256 $got does not match the pin $SHA256" >&2
  exit 1
fi
tar -xzf "$tgz" -C "$tmp"
mkdir -p uplot
cp "$tmp/package/dist/uPlot.esm.js" "$tmp/package/dist/uPlot.min.css" "$tmp/package/LICENSE" uplot/
printf 'uplot %s (npm), tarball sha256 %s\nfiles: dist/uPlot.esm.js, dist/uPlot.min.css, LICENSE (MIT)\n' \
  "$VERSION" "$got" > uplot/VERSION
echo "vendored uplot $VERSION (sha256 $got)"
