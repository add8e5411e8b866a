# Writes OUTPUT, a C++ source defining `const unsigned char SYMBOL[]` (in NAMESPACE) with
# the bytes of INPUT. Run as: cmake -DINPUT=... -DOUTPUT=... -DSYMBOL=... -DNAMESPACE=... -P
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" digits)
math(EXPR bytes "${digits} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n" body "${body}")
file(WRITE "${OUTPUT}" "// Generated from ${INPUT} by cmake/embed_file.cmake; do not edit.\n"
  "namespace ${NAMESPACE} {\n"
  "// ${bytes} bytes; aligned for the CUDA driver, which reads it in place.\n"
  "alignas(64) extern const unsigned char ${SYMBOL}[] = {\n${body}\n};\n"
  "}  // namespace ${NAMESPACE}\n")
