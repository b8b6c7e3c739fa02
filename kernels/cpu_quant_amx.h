// The AMX-INT8 path of the k-quant matmul (kernels/cpu_quant_amx.cpp), as cpu_quant_matmul.cpp calls it.
#pragma once
#include <cstdint>
#include <vector>

namespace specd_quant_amx {

// Whether Q4_K and Q6_K weights take this path, for every row count: a build with AVX-512, a CPU
// with AMX-TILE and AMX-INT8, Linux granting the tile data, and SPECD_CPU_AMX not 0.
bool usable();

// x's rows, quantized per 256 (cpu_quant_matmul.cpp's quantize_rows), in the tiles' layouts: groups
// of up to 16 rows (mg columns of a tile; past 16 rows every group has 16, the last padded with zero
// rows). xb [K / 4][mg][4] (a B tile per sub-block), dx [blocks][16] (lane m: row m's scale),
// xsp [blocks][4][16] (lane m: row m's sums of sub-blocks 2p and 2p + 1 as an int16 pair).
struct Group {
  int64_t r0 = 0;
  int rows = 0, mg = 0;
  std::vector<int8_t> xb, xd2, xd4;  // (xd2, xd4: one row's B tiles with 2 and 4 sub-blocks side by side)
  std::vector<float> dx;
  std::vector<int32_t> xsp;
};
struct Rows {
  std::vector<Group> groups;
};

Rows prepare(const int8_t* q, const float* d, const int32_t* sums, int64_t M, int64_t K);

// `cols` weight rows of GGML type `type` (Q4_K = 12 or Q6_K = 14), ldw bytes apart, against all rows
// of x -> out[M][ldo], columns 0 .. cols - 1.
void k_rows(int64_t type, const uint8_t* w, int64_t ldw, int64_t cols, const Rows& x, int64_t K, float* out,
            int64_t ldo);

}  // namespace specd_quant_amx
