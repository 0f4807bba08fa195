/* AMX's tile instructions in C, for a test build only (SF_AMX_EMULATE; the
 * shipped extension never defines it): tests/kernels/test_amx_emulated.py
 * runs the amx-bf16 path's code (its tile shapes, strides, tails and
 * reconfigurations, the packing, the dispatch) on a CPU without AMX.
 *
 * What the hardware faults on aborts here with a message: a tile used
 * before a configuration or after a release, a palette other than 1, a
 * shape past 16 rows x 64 bytes, a tdpbf16ps whose shapes disagree or whose
 * tiles are not three (stricter than the hardware on a nonzero start_row;
 * like it, no bounds check on what a load reads). TDPBF16PS follows the
 * SDM's pseudo-code: per row, the even and the odd products summed apart
 * over the instruction's pairs from zero, then the two sums added, then
 * added to the accumulator, in float32 to nearest even with denormals
 * flushed whatever the caller's MXCSR (as the hardware ignores it); each
 * product is rounded before its add where the SDM fuses them, which differs
 * only for a product below float32's normal range. Real tiles may order
 * their sums otherwise: the bits of the class are the hardware's, which is
 * why sf_amx_verify checks the kernel against float64 where it runs, not
 * against this. A build with it offers its tiles only to a process that
 * sets SUPERFLUID_AMX_EMULATED=1 (sf_pool.c): never to a worker by mistake.  */
#ifndef SF_AMX_EMU_H
#define SF_AMX_EMU_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xmmintrin.h>

typedef struct {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
} emu_tiles;

static _Thread_local emu_tiles emu;

static void emu_fault(const char *what, int t) {
    fprintf(stderr, "sf_amx_emu: %s (tile %d): the hardware would fault\n", what, t);
    abort();
}

static void emu_used(int t) {
    if (!emu.configured) emu_fault("a tile instruction with no configuration loaded", t);
    if (t < 0 || t > 7) emu_fault("no such tile", t);
    if (emu.rows[t] == 0 || emu.colsb[t] == 0) emu_fault("a tile the configuration leaves unused", t);
}

static void emu_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    if (c[0] != 1) emu_fault("palette other than 1", -1);
    if (c[1] != 0) emu_fault("start_row not zero", -1);
    for (int i = 2; i < 16; i++)
        if (c[i]) emu_fault("reserved configuration bytes not zero", -1);
    memset(&emu, 0, sizeof emu); /* (every tile zeroed) */
    for (int t = 0; t < 16; t++) {
        uint16_t colsb = (uint16_t)(c[16 + 2 * t] | c[17 + 2 * t] << 8);
        uint8_t rows = c[48 + t];
        if (t >= 8) {
            if (colsb || rows) emu_fault("a tile past the eighth configured", t);
            continue;
        }
        if (rows > 16 || colsb > 64) emu_fault("a shape past 16 rows x 64 bytes", t);
        if ((rows == 0) != (colsb == 0)) emu_fault("a shape with rows or bytes but not both", t);
        emu.rows[t] = rows, emu.colsb[t] = colsb;
    }
    emu.configured = 1;
}

static void emu_release(void) { memset(&emu, 0, sizeof emu); }

static void emu_loadd(int t, const void *base, long stride) {
    emu_used(t);
    memset(emu.data[t], 0, sizeof emu.data[t]);
    for (int r = 0; r < emu.rows[t]; r++) memcpy(emu.data[t][r], (const uint8_t *)base + r * stride, emu.colsb[t]);
}

static void emu_stored(int t, void *base, long stride) {
    emu_used(t);
    for (int r = 0; r < emu.rows[t]; r++) memcpy((uint8_t *)base + r * stride, emu.data[t][r], emu.colsb[t]);
}

static float emu_bf16(const uint8_t *p) {
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void emu_dpbf16ps(int c, int a, int b) {
    unsigned csr = _mm_getcsr();
    _mm_setcsr((csr & ~0x6000u) | 0x8040u); /* FTZ, DAZ, to nearest even */
    emu_used(c), emu_used(a), emu_used(b);
    if (c == a || c == b || a == b) emu_fault("tdpbf16ps with a tile twice", c);
    int M = emu.rows[c], N = emu.colsb[c] / 4, K = emu.colsb[a] / 4;
    if (emu.rows[a] != M || emu.colsb[b] != emu.colsb[c] || emu.rows[b] != K || emu.colsb[a] % 4)
        emu_fault("tdpbf16ps shapes that disagree (C: M x N, A: M x K pairs, B: K x N pairs)", c);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float even = 0, odd = 0, acc;
            for (int k = 0; k < K; k++) {
                even += emu_bf16(&emu.data[a][m][4 * k]) * emu_bf16(&emu.data[b][k][4 * n]);
                odd += emu_bf16(&emu.data[a][m][4 * k + 2]) * emu_bf16(&emu.data[b][k][4 * n + 2]);
            }
            memcpy(&acc, &emu.data[c][m][4 * n], 4);
            acc += even + odd;
            memcpy(&emu.data[c][m][4 * n], &acc, 4);
        }
    _mm_setcsr(csr);
}

#define AMX_LOADCONFIG(c) emu_loadconfig(c)
#define AMX_RELEASE() emu_release()
#define AMX_LOADD(t, p, s) emu_loadd(t, p, s)
#define AMX_STORED(t, p, s) emu_stored(t, p, s)
#define AMX_DPBF16PS(c, a, b) emu_dpbf16ps(c, a, b)

#endif
