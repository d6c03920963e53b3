"""The Triton kernels behind :func:`fp8_recipes.observe.stats.measure_fused` (imported only there, lazily).

One kernel quantizes an operand and reduces it to its statistics in one pass over memory: each program loads a
tile of whole blocks, takes the block amaxes, derives the block scales with the numerics core's rules (TE's
``compute_scale_from_amax``, ``force_pow_2_scales``; MXFP8's E8M0 codes), rounds to FP8 in registers and adds its
partial sums to the operand's output with atomics. Tensorwise scaling needs the tensor's amax before any scale,
so :func:`amax_kernel` runs first. Nothing of the size of the operand is written (unless a test asks for the
dequantized tensor, ``STORE_FQ``).

FP8 rounding is done with integer and float32 arithmetic (round-to-nearest-even on the format's grid, subnormals
included, saturating to ±max, NaN kept), not with a hardware cast: the same code runs on any GPU Triton supports
and in Triton's CPU interpreter (``TRITON_INTERPRET=1``, which tests use on machines without a GPU).

Output layout (one float64 buffer per operand, see ``stats.measure_fused``): ``out64[0:8]`` the sums of
``stats._SUMS`` (numel, nonzero, underflow, saturated, sum sq err, <x,fq>, |x|^2, |fq|^2), ``out32[0:3]`` (the
next two slots viewed as float32) amax, min_nonzero, per-tensor scale, then 256 int32 counts of power-of-two block
scales by exponent (their minimum and median without a sort on the device).

``stats.measure_fused`` launches them through :data:`stats` and :data:`amax` (:class:`Launcher`: after Triton's
first launch of a specialization, the compiled kernel is called directly).
"""

import inspect
import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

MODE_DELAYED = 0     # per-tensor scale read from scale_ptr
MODE_TENSORWISE = 1  # per-tensor scale from the amax already in out32[0] (amax_kernel)
MODE_BLOCKWISE = 2   # a float32 scale per block: fp8_max / block amax
MODE_MXFP8 = 3       # an E8M0 exponent per block


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e in [-127, 127] (2^-127 is subnormal)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    sub = (tl.full(e.shape, 1 << 22, tl.int32)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def _amax_to_scale(amax, fp8_max, epsilon, margin_mult, value_for_inf, POW2: tl.constexpr):
    """numerics.scaling.amax_to_scale, elementwise."""
    amax = tl.where(amax < epsilon, epsilon, amax)
    degenerate = (amax == 0) | (amax != amax) | (amax == float("inf"))
    safe = tl.where(degenerate, 1.0, amax)
    scale = tl.math.div_rn(tl.full(safe.shape, fp8_max, tl.float32), safe)
    scale = tl.where(scale == float("inf"), value_for_inf, scale)
    scale = scale * margin_mult
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # sign + exponent
    return tl.where(degenerate, 1.0, scale)


@triton.jit
def _e8m0(amax, rcp, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """numerics.scaling.amax_to_e8m0 (amax never NaN here), as int32 codes in [0, 254]."""
    if RCEIL:
        val = amax * rcp
        bits = val.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        mantissa = bits & 0x7FFFFF
        up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
        code = exponent + up.to(tl.int32)
        code = tl.where(val == float("inf"), 0xFE, code)
        code = tl.where(val == 0, 0, code)
    else:
        bits = amax.to(tl.int32, bitcast=True)
        code = ((bits >> 23) & 0xFF) - EMAX
        code = tl.where(amax == float("inf"), 0xFE, code)
    return tl.minimum(tl.maximum(code, 0), 254)


@triton.jit
def _block_max(mag, BR: tl.constexpr, BC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
    """The max of each (BR, BC) block of a (TR, TC) tile, as (TR // BR, TC // BC): columns reduced, then rows. A
    block as wide (or as tall) as the tile reduces that axis of the tile itself (no reshape: a (64, 1, 128) view
    takes ptxas minutes)."""
    if BC == TC:
        m = tl.max(mag, axis=1, keep_dims=True)
    elif BC == 1:
        m = mag
    else:
        m = tl.max(tl.reshape(mag, (TR, TC // BC, BC)), axis=2)
    if BR == TR:
        m = tl.max(m, axis=0, keep_dims=True)
    elif BR != 1:
        m = tl.max(tl.reshape(m, (TR // BR, BR, TC // BC)), axis=1)
    return m


@triton.jit
def _per_element(per_block, BR: tl.constexpr, BC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
    """(TR // BR, TC // BC) block values spread over their tile's elements, as a shape that broadcasts against
    (TR, TC): a block as wide (tall) as the tile keeps its axis of size 1."""
    v = per_block
    if BR != 1 and BR != TR:
        v = tl.reshape(tl.broadcast_to(tl.reshape(v, (TR // BR, 1, TC // BC)), (TR // BR, BR, TC // BC)),
                       (TR, TC // BC))
    if BC != 1 and BC != TC:
        rows: tl.constexpr = 1 if BR == TR else TR
        v = tl.reshape(tl.broadcast_to(tl.reshape(v, (rows, TC // BC, 1)), (rows, TC // BC, BC)), (rows, TC))
    return v


@triton.jit
def _round_fp8(a, fp8_max, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """|y| (>= 0 or NaN) rounded to the FP8 grid (MBITS mantissa bits, smallest normal exponent EMIN),
    nearest-even, saturating at fp8_max (inf too); NaN stays NaN."""
    a = tl.where(a > fp8_max, fp8_max, a)  # NaN > max is false: NaN kept
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN) - MBITS  # the exponent of one step of the grid at a's binade (subnormals: EMIN's)
    step = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = a * inv  # exact (a power of two), < 2^(MBITS + 1)
    r = (v + 8388608.0) - 8388608.0  # round half to even at integers: 2^23 leaves no fraction bits
    return r * step


@triton.jit
def amax_kernel(x_ptr, rows, cols, out32_ptr, TR: tl.constexpr, TC: tl.constexpr):
    """max |x| (NaN ignored) of a contiguous (rows, cols) tensor into out32[0] (initialised to 0)."""
    r = tl.program_id(0) * TR + tl.arange(0, TR)[:, None]
    c = tl.program_id(1) * TC + tl.arange(0, TC)[None, :]
    m = (r < rows) & (c < cols)
    x = tl.load(x_ptr + r.to(tl.int64) * cols + c, mask=m, other=0.0).to(tl.float32)
    mag = tl.abs(x)
    mag = tl.where(mag == mag, mag, 0.0)
    tl.atomic_max(out32_ptr, tl.max(tl.max(mag, axis=1), axis=0))


@triton.jit
def stats_kernel(x_ptr, rows, cols, scale_ptr, out64_ptr, out32_ptr, bscale_ptr, hist_ptr, fq_ptr,
                 fp8_max, clip, epsilon, margin_mult, value_for_inf, rcp,
                 MODE: tl.constexpr, POW2: tl.constexpr, RCEIL: tl.constexpr, HIST: tl.constexpr,
                 MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr, STORE_FQ: tl.constexpr):
    """Quantize a contiguous (rows, cols) tensor under one scaling mode and add its statistics to the outputs.
    Blocks are (BR, BC); a program's tile (TR, TC) holds whole blocks. Block modes write their scales to
    bscale_ptr (row_blocks, col_blocks) and, with HIST (scales that are powers of two), count them by exponent
    field in hist_ptr (256 int32)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * TR + tl.arange(0, TR)[:, None]
    c = pid_c * TC + tl.arange(0, TC)[None, :]
    m = (r < rows) & (c < cols)
    offs = r.to(tl.int64) * cols + c
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    mag = tl.abs(x)
    mag = tl.where(mag == mag, mag, 0.0)  # NaN is no amax, never zero, never clipped

    if MODE == 0 or MODE == 1:
        if MODE == 0:
            scale = tl.load(scale_ptr)
        else:
            scale = _amax_to_scale(tl.load(out32_ptr), fp8_max, epsilon, margin_mult, value_for_inf, POW2)
        scale_inv = tl.math.div_rn(1.0, scale)
        s = tl.full((TR, TC), 1.0, tl.float32) * scale
        s_inv = tl.full((TR, TC), 1.0, tl.float32) * scale_inv
        if pid_r == 0 and pid_c == 0:
            tl.store(out32_ptr + 2, scale)
    else:
        bamax = _block_max(mag, BR, BC, TR, TC)
        if MODE == 2:
            bscale = _amax_to_scale(bamax, fp8_max, epsilon, margin_mult, value_for_inf, POW2)
            bscale_inv = tl.math.div_rn(tl.full(bscale.shape, 1.0, tl.float32), bscale)
        else:
            code = _e8m0(bamax, rcp, EMAX, RCEIL)
            bscale = tl.where(code == 0, 1.0, _pow2(127 - code))
            bscale_inv = _pow2(code - 127)
        br = pid_r * (TR // BR) + tl.arange(0, TR // BR)[:, None]
        bc = pid_c * (TC // BC) + tl.arange(0, TC // BC)[None, :]
        row_blocks = (rows + BR - 1) // BR
        col_blocks = (cols + BC - 1) // BC
        valid = (br < row_blocks) & (bc < col_blocks)
        tl.store(bscale_ptr + br * col_blocks + bc, bscale, mask=valid)
        if HIST:  # power-of-two scales: their exponent field counts them exactly (min and median on the host)
            # counted in the program first (blocks outside the tensor in bins 256+, dropped), then one atomic
            # per bin in use: a tile's scales share a few exponents, and an atomic per block would queue on them
            field = tl.where(valid, (bscale.to(tl.int32, bitcast=True) >> 23) & 0xFF, 256)
            counts = tl.histogram(tl.reshape(field, ((TR // BR) * (TC // BC),)), 512)
            bins = tl.arange(0, 512)
            tl.atomic_add(hist_ptr + bins, counts, mask=(bins < 256) & (counts > 0))
        s = _per_element(bscale, BR, BC, TR, TC)
        s_inv = _per_element(bscale_inv, BR, BC, TR, TC)

    y = x * s
    qa = _round_fp8(tl.abs(y), fp8_max, MBITS, EMIN)
    fq = tl.where(y < 0, -qa, qa) * s_inv
    if STORE_FQ:
        tl.store(fq_ptr + offs, fq, mask=m)

    nonzero = m & (x != 0)  # NaN != 0
    ones = tl.full((TR, TC), 1.0, tl.float32)
    zeros = tl.zeros((TR, TC), tl.float32)
    err = fq - x  # masked-out elements are 0 and add nothing to the float sums
    tl.atomic_add(out64_ptr + 0, tl.sum(tl.sum(tl.where(m, ones, zeros), axis=1), axis=0).to(tl.float64))
    tl.atomic_add(out64_ptr + 1, tl.sum(tl.sum(tl.where(nonzero, ones, zeros), axis=1), axis=0).to(tl.float64))
    tl.atomic_add(out64_ptr + 2, tl.sum(tl.sum(tl.where(nonzero & (fq == 0), ones, zeros), axis=1),
                                        axis=0).to(tl.float64))
    tl.atomic_add(out64_ptr + 3, tl.sum(tl.sum(tl.where(m & (mag * s > clip), ones, zeros), axis=1),
                                        axis=0).to(tl.float64))
    tl.atomic_add(out64_ptr + 4, tl.sum(tl.sum(err * err, axis=1), axis=0).to(tl.float64))
    tl.atomic_add(out64_ptr + 5, tl.sum(tl.sum(x * fq, axis=1), axis=0).to(tl.float64))
    tl.atomic_add(out64_ptr + 6, tl.sum(tl.sum(x * x, axis=1), axis=0).to(tl.float64))
    tl.atomic_add(out64_ptr + 7, tl.sum(tl.sum(fq * fq, axis=1), axis=0).to(tl.float64))
    if MODE != 1:  # tensorwise: amax_kernel wrote it
        tl.atomic_max(out32_ptr, tl.max(tl.max(mag, axis=1), axis=0))
    tl.atomic_min(out32_ptr + 1, tl.min(tl.min(tl.where(mag > 0, mag, float("inf")), axis=1), axis=0))


class Launcher:
    """``kernel[grid](*args, **constexprs)``, launching Triton's compiled kernel directly once one exists for the
    call's specialization: Triton's own launch binds and specializes every argument and looks the kernel up on each
    call, which is most of a launch's host time (tens of microseconds on a slow host, per operand of a recorded
    step). The direct call is the one Triton's ``JITFunction.run`` makes (Triton 3.3 and later; torch inductor's
    launchers make it too): ``compiled.run(grid, stream, function, packed_metadata, launch_metadata, hooks, *args)``.

    The cache key holds everything Triton specializes a launch on: each tensor's dtype and 16-byte alignment, each
    integer's type range, divisibility by 16 and equality to 1, each scalar's type, the constexprs, the warps and
    the device. Triton's own path is taken on a miss (which compiles or finds the kernel, then is remembered), under
    the interpreter, while a launch hook is set (profilers), and for good once a direct launch fails.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, tuple] = {}
        self.direct = True
        self.direct_launches = 0
        """Launches that went straight to the compiled kernel (tests check that the path is taken)."""
        self._names = None

    def __call__(self, grid: tuple[int, int], args: tuple, constexprs: tuple, num_warps: int) -> None:
        key = (_spec_key(args), constexprs, num_warps)
        hit = self.compiled.get(key) if self.direct else None
        if hit is not None and not _hooked():
            run, function, metadata, device = hit
            try:
                run(grid[0], grid[1], 1, _stream(device), function, metadata, None, None, None, *args, *constexprs)
                self.direct_launches += 1
                return
            except Exception as e:  # noqa: BLE001 - a Triton whose launch convention differs: its own path from now on
                self.direct = False
                logger.warning("numerics statistics: launching the compiled Triton kernel directly failed (%s: %s); "
                               "launching through Triton from now on", type(e).__name__, e)
        if self._names is None:
            self._names = list(inspect.signature(self.kernel.fn).parameters)[len(args):]
            assert len(self._names) == len(constexprs), (self._names, constexprs)
        compiled = self.kernel[grid](*args, **dict(zip(self._names, constexprs)), num_warps=num_warps)
        x = args[0]
        if (self.direct and hit is None and getattr(x, "is_cuda", False) and hasattr(compiled, "packed_metadata")
                and x.device.index == torch.cuda.current_device()):  # Triton launched on the current device
            self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata, x.device.index)


def _spec_key(args: tuple) -> tuple:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0, a.device.index))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append(type(a))
        else:
            key.append((a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63))  # i32 / i64 / u64
    return tuple(key)


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps a HookChain there, set when it holds a call)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # a Triton before knobs (3.4): no direct launches
        return True
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


stats = Launcher(stats_kernel)
"""stats_kernel's launcher: ``stats(grid, args, constexprs, num_warps)``, constexprs in the signature's order."""
amax = Launcher(amax_kernel)
"""amax_kernel's launcher."""
