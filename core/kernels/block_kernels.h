#ifndef ATTNSERVE_CORE_KERNELS_BLOCK_KERNELS_H_
#define ATTNSERVE_CORE_KERNELS_BLOCK_KERNELS_H_

// Private to core/: attnserve's own AVX-512 products for the blocked
// (flash-style) attention path, in place of two oneDNN matmul executions per
// key block. The blocked path computes a strip of up to kStripRows query rows
// against one key block at a time -- scores, online softmax, P V -- so that a
// strip's scores and probabilities stay in L1, and it runs no oneDNN primitive
// (and so makes no allocation) per block.
//
// Layouts. A key block of `keys` rows is packed once per call (not per query
// block or query head) into tiles of kKeyTile keys, zero-padded:
//   keys, FP32:   [tiles][head_dim][16]        (K^T of each tile)
//   keys, BF16:   [tiles][head_dim / 2][16][2] (pairs of dimensions, the
//                                               operand layout of VDPBF16PS)
//   values, BF16: [tiles * 8][head_dim][2]     (pairs of keys)
// FP32 values are read where they are (row-major rows with a row stride).
//
// The products accumulate in FP32 (BF16: products of BF16 pairs summed in
// FP32 by VDPBF16PS).

#include <cstdint>

#include "core/bf16.h"

namespace attnserve::core::internal {

// Keys per packed tile: one AVX-512 vector of FP32 scores.
constexpr int64_t kKeyTile = 16;
// Query rows computed together against a key block.
constexpr int64_t kStripRows = 8;

// Whether these kernels run the blocks of this precision and head_dim on this
// CPU: AVX-512 F/BW/DQ/VL (BF16: also AVX512-BF16) and head_dim a multiple of
// 16. Otherwise the blocked path runs its blocks on oneDNN.
bool OwnBlockKernelsAvailable(bool bf16, int64_t head_dim);

// Elements of one packed key block (and of one packed BF16 value block).
int64_t PackedBlockElements(int64_t keys, int64_t head_dim);

// Packs keys [0, keys) of a block (row j at k + j * row_stride elements) in
// the layout above; rows >= valid are written as zeros, not read.
void PackKeyBlock(const void* k, int64_t row_stride, int64_t keys, int64_t valid, int64_t head_dim,
                  bool bf16, void* packed);
void PackValueBlockBf16(const Bf16* v, int64_t row_stride, int64_t keys, int64_t valid,
                        int64_t head_dim, Bf16* packed);

// scores [rows][scores_stride] (key columns [0, tiles * 16)) =
//   q [rows, head_dim] (row stride q_stride) x K^T of the tiles [0, tiles) of
//   a packed key block, unscaled (the softmax applies the scale). rows <=
//   kStripRows.
void BlockScores(bool bf16, const void* q, int64_t q_stride, int64_t rows, const void* k_packed,
                 int64_t tiles, int64_t head_dim, float* scores, int64_t scores_stride);

// acc [rows][head_dim] (row stride acc_stride) =
//   (first ? 0 : acc * alpha[r]) + p [rows][0, keys) x V [0, keys)
// BF16: p BF16 with row stride p_stride, keys even and within the packed
// block's padded keys, v_packed a packed value block.
// FP32: p FP32, v [keys] rows of head_dim with row stride v_stride.
void BlockValuesBf16(const Bf16* p, int64_t p_stride, int64_t rows, int64_t keys,
                     const Bf16* v_packed, int64_t head_dim, const float* alpha, bool first,
                     float* acc, int64_t acc_stride);
void BlockValuesFp32(const float* p, int64_t p_stride, int64_t rows, int64_t keys, const float* v,
                     int64_t v_stride, int64_t head_dim, const float* alpha, bool first, float* acc,
                     int64_t acc_stride);

}  // namespace attnserve::core::internal

#endif  // ATTNSERVE_CORE_KERNELS_BLOCK_KERNELS_H_
