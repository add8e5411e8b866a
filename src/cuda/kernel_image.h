// The kernels' image: the fatbinary nvcc compiled from kernels.cu, which kernel_image.cc
// embeds in the library and kernels.cc hands to the CUDA driver.
#pragma once

/// The image's first byte (a fatbinary: its header says how long it is); 64-byte aligned.
extern "C" const unsigned char loom_kernel_image[];
