# Sourced by the benchmark scripts: with DEBS=DIR set, unpacks the .deb files in DIR
# (Debian's libfabric, OpenSSL and iproute2 and what they need) and points this shell's
# PATH, libraries, headers and CMAKE_ARGS at them, for hosts that cannot install them (the
# GPU hosts). Without DEBS it does nothing.
if [ -n "${DEBS:-}" ]; then
  root=/tmp/loom-debs
  mkdir -p "$root"
  for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$root"; done
  lib=$root/usr/lib/x86_64-linux-gnu
  # Only this script's processes see the unpacked libraries.
  export PATH=$root/usr/sbin:$root/sbin:$root/bin:$PATH
  export LD_LIBRARY_PATH=$lib:$root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export PKG_CONFIG_PATH=$lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$root
  export CPATH=$root/usr/include:$root/usr/include/x86_64-linux-gnu
  export CMAKE_ARGS="-DOPENSSL_ROOT_DIR=$root/usr -DOPENSSL_CRYPTO_LIBRARY=$lib/libcrypto.so -DOPENSSL_INCLUDE_DIR=$root/usr/include"
fi
