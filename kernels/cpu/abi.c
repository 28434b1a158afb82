/* The structs' sizes as this compiler lays them out, for the ctypes mirror to check itself
   against (kernels/native/cpu_abi.py, tests/kernels/native/test_cpu_abi.py). */
#include "deepinfer_kernels.h"

long di_sizeof_rms_norm_args(void) { return (long)sizeof(di_rms_norm_args); }

long di_sizeof_attention_args(void) { return (long)sizeof(di_attention_args); }

long di_sizeof_matrix(void) { return (long)sizeof(di_matrix); }

long di_sizeof_llama_layer(void) { return (long)sizeof(di_llama_layer); }

long di_sizeof_llama_step(void) { return (long)sizeof(di_llama_step); }
