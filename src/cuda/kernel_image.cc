// The kernels' fatbinary, embedded in the library by the assembler (.incbin of the file
// nvcc wrote, LOOM_KERNEL_FATBIN): written out as a C array of its 16 MB, the image cost
// the compiler about a minute of every build.
#include "cuda/kernel_image.h"

#ifndef LOOM_KERNEL_FATBIN
#error "the fatbinary to embed is not named: CMakeLists.txt defines its path for this file"
#endif

// In a read-only section of its own, aligned for the CUDA driver, which reads it in place.
asm(".pushsection .rodata.loom_kernel_image, \"a\", @progbits\n"
    ".balign 64\n"
    ".globl loom_kernel_image\n"
    ".hidden loom_kernel_image\n"
    ".type loom_kernel_image, @object\n"
    "loom_kernel_image:\n"
    ".incbin \"" LOOM_KERNEL_FATBIN
    "\"\n"
    ".size loom_kernel_image, . - loom_kernel_image\n"
    ".popsection\n");
