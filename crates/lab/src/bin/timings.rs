//! Timings of the CUDA backend's ops at the Llama-3.2-1B shapes (4-bit, group 64, bf16
//! scales; random weights), each op checked against the CPU backend first where it can be:
//!   gemv       the decode GEMVs (norm→q/k/v, o + add, norm→gate/up→SwiGLU, down + add, a
//!              whole layer of five launches, norm→head), per launch in a captured graph
//!   attention  decode attention over 512 and 8191 cached positions (parity: the engine's
//!              rope_attention test)
//!   sampling   device argmax and top-k over a 128K vocabulary (parity: the engine's tests)
//!   flash      flash prefill of 512 rows at depth 0 and 8192 against the split-K attention
//!   qgemm      the tensor-core GEMM at prefill size (64- and 128-token tiles) against the
//!              matmul path at the 1B and 8B shapes
//!   wgmma      the wgmma GEMMs (the lab's kernels/qgemm_wgmma.cu forms, the product's), at
//!              512 and 4096 tokens on the 1B and 8B shapes: bits against the tiled
//!              kernel's, error against the CPU, then time beside the product's GEMM
//!   few        the few-token GEMM (1 to 64 tokens: the serving engine's calls) against
//!              the tiled one and the GEMV path at the 1B and 8B shapes, checked for equal
//!              bits with the tiled kernel
//!
//!   bgemv      the lab's batched decode GEMV (kernels/bgemv.cuh) at 1 to 64 tokens on the
//!              1B and 8B shapes: each token's bits against the product GEMV on that token
//!              alone, then its time beside the serving path's GEMMs
//!
//!   usage: timings [gemv|attention|sampling|flash|qgemm|wgmma|few|bgemv|all]... [--copies N] [--timing-only]
//!                  [--seed S]
//!
//! Graph-timed launches cycle over `--copies` device copies of the weights (default 16), as
//! a decode step walks 16 layers: one copy would stay in the 50 MB L2 and time L2, not HBM
//! (`--copies 1` times that on purpose: the ceiling of any L2 prefetch). `--timing-only`
//! skips the parity checks, for kernel variants (FERROLM_KERNEL_DIR) that compute something
//! else. Timings go to stdout for the record (docs/perf-log.md), never judged; exits 1 when
//! a check fails or an op errs, 2 on bad arguments.

use ferrolm::backend::cpu::{Cpu, CpuMat};
use ferrolm::backend::cuda::{Cuda, CudaAct, CudaMat};
use ferrolm::backend::{Attend, Backend, Rope};
use ferrolm::config::{Activation, RopeStyle};
use ferrolm::quant::{AffineTensor, ScaleDtype, Weight};
use ferrolm::Result;
use ferrolm_lab::timing::{attn_cfg, bf, cpu, graph_time, report, stream_time, Checks, Rng};

const USAGE: &str =
    "usage: timings [gemv|attention|sampling|flash|qgemm|wgmma|few|bgemv|all]... [--copies N] [--timing-only] [--seed S]";
/// The H200's bf16 dense matmul rate as measured (GPU-FACTS.md), FLOP/s.
const BF16_DENSE_FLOPS: f64 = 790e12;
const ALL: [&str; 8] = ["gemv", "attention", "sampling", "flash", "qgemm", "wgmma", "few", "bgemv"];

/// What a timing section gets: the device, fresh random inputs, the checks and the options.
struct Session<'a> {
    g: &'a Cuda,
    r: Rng,
    checks: Checks,
    /// Weight copies graph-timed launches cycle over (`--copies`).
    copies: usize,
}

fn bad_args(msg: &str) -> ! {
    eprintln!("timings: {msg}\n{USAGE}");
    std::process::exit(2)
}

fn main() {
    let (mut which, mut copies, mut timing_only, mut seed) = (Vec::new(), 16, false, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> u64 {
            args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| bad_args(&format!("{name} takes a number")))
        };
        match a.as_str() {
            "--copies" => copies = num("--copies").max(1) as usize,
            "--seed" => seed = Some(num("--seed")),
            "--timing-only" => timing_only = true,
            "all" => which.extend(ALL.map(String::from)),
            w if ALL.contains(&w) => which.push(a),
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            _ => bad_args(&format!("unknown argument {a:?}")),
        }
    }
    if which.is_empty() {
        which.extend(ALL.map(String::from));
    }
    let cuda = Cuda::new(0).unwrap_or_else(|e| {
        eprintln!("timings: {e}");
        std::process::exit(1)
    });
    println!("{} ({}, {} SMs); weight copies {copies}", cuda.device_name, cuda.arch, cuda.sms);
    let checks = Checks { timing_only, ..Default::default() };
    let mut lab = Session { g: &cuda, r: Rng::new(seed), checks, copies };
    let mut errors = Vec::new();
    for w in &which {
        let r = match w.as_str() {
            "gemv" => gemvs_at_1b_shapes(&mut lab),
            "attention" => decode_attention(&mut lab),
            "sampling" => decode_sampling(&mut lab),
            "flash" => flash_prefill(&mut lab),
            "few" => few_token_gemm(&mut lab),
            "wgmma" => wgmma_gemm(&mut lab),
            "bgemv" => batched_gemv(&mut lab),
            _ => qgemm(&mut lab),
        };
        if let Err(e) = r {
            eprintln!("timings {w}: FAILED: {e}");
            errors.push(format!("{w}: {e}"));
        }
    }
    errors.append(&mut lab.checks.failed);
    if !errors.is_empty() {
        eprintln!("timings: {} failed:\n  {}", errors.len(), errors.join("\n  "));
        std::process::exit(1);
    }
}

/// A random rows × cols matrix in the 1B's format: on the device, as the CPU's matrix, and
/// the weight itself.
fn mat(g: &Cuda, r: &mut Rng, rows: usize, cols: usize) -> Result<(CudaMat, CpuMat, Weight)> {
    let w = Weight::Affine(AffineTensor::quantize(&r.v(rows * cols, 0.05), rows, cols, 4, 64, ScaleDtype::BF16)?);
    Ok((g.matrix(w.clone())?, CpuMat::new(w.clone()), w))
}

/// `n` device copies of `w` (layers of a decode step).
fn copies(g: &Cuda, w: &Weight, n: usize) -> Result<Vec<CudaMat>> {
    (0..n).map(|_| g.matrix(w.clone())).collect()
}

fn bytes(ws: &[&Weight]) -> usize {
    ws.iter().map(|w| w.byte_size()).sum()
}

/// The decode GEMVs at the 1B shapes: parity with the CPU composition, then the time per
/// launch inside a captured graph, as a decode step runs them.
fn gemvs_at_1b_shapes(lab: &mut Session) -> Result<()> {
    let (g, c, n) = (lab.g, Cpu, lab.copies);
    let (r, checks) = (&mut lab.r, &mut lab.checks);
    let (d, kvd, f, vocab) = (2048, 512, 8192, 128256);
    let x = r.v(d, 20.0);
    let norm = r.v(d, 1.0);
    let (xg, xc) = (g.act_from_f32(1, d, &x)?, cpu(1, d, x.clone()));
    let ng = g.vector(norm.clone())?;
    let (mut xn, mut xnc) = (g.act(1, d)?, c.act(1, d)?);

    // norm → q/k/v (one launch)
    let (wq, wk, wv) = (mat(g, r, d, d)?, mat(g, r, kvd, d)?, mat(g, r, kvd, d)?);
    let mut og = [d, kvd, kvd].iter().map(|&n| g.act_poisoned(1, n, false)).collect::<Result<Vec<_>>>()?;
    let mut oc = [d, kvd, kvd].iter().map(|&n| c.act(1, n)).collect::<Result<Vec<_>>>()?;
    {
        let [a, b, e] = &mut og[..] else { unreachable!() };
        g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wq.0, &wk.0, &wv.0], &mut [a, b, e])?;
        let [a, b, e] = &mut oc[..] else { unreachable!() };
        c.norm_matmul_many(&xc, &norm, 1e-5, &mut xnc, &[&wq.1, &wk.1, &wv.1], &mut [a, b, e])?;
    }
    for (i, (a, b)) in og.iter().zip(&oc).enumerate() {
        checks.check(&format!("1B norm→qkv[{i}]"), &g.read_rows(a, 0)?, &b.data, 1e-2);
    }
    let (cq, ck, cv) = (copies(g, &wq.2, n)?, copies(g, &wk.2, n)?, copies(g, &wv.2, n)?);
    let us = graph_time(g, 48, &mut |i| {
        let [a, b, e] = &mut og[..] else { unreachable!() };
        let j = i % n;
        g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&cq[j], &ck[j], &cv[j]], &mut [a, b, e])
    })?;
    report("1B norm→q/k/v 2048+512+512×2048", us, bytes(&[&wq.2, &wk.2, &wv.2]));

    // o: GEMV + residual add
    let wo = mat(g, r, d, d)?;
    let y = bf(&r.v(d, 1.0));
    let yg = g.act_from(1, d, &y)?;
    let mut rg = g.act_from_f32(1, d, &x)?;
    let mut tmp = g.act(1, d)?;
    g.matmul_add(&yg, &wo.0, &mut rg, &mut tmp)?;
    let (mut rc, mut tmpc) = (xc.clone(), c.act(1, d)?);
    c.matmul_add(&cpu(1, d, y), &wo.1, &mut rc, &mut tmpc)?;
    // The added part (the residual itself is exact).
    let delta = |v: Vec<f32>| v.iter().zip(&x).map(|(a, b)| a - b).collect::<Vec<f32>>();
    checks.check("1B o + residual", &delta(g.read_rows(&rg, 0)?), &delta(rc.data), 1e-2);
    let co = copies(g, &wo.2, n)?;
    let us = graph_time(g, 48, &mut |i| g.matmul_add(&yg, &co[i % n], &mut rg, &mut tmp))?;
    report("1B o 2048×2048 + add", us, bytes(&[&wo.2]));

    // norm → gate/up → SwiGLU (one launch)
    let (wg, wu) = (mat(g, r, f, d)?, mat(g, r, f, d)?);
    let (mut gg, mut ug, mut sg) = (g.act(1, f)?, g.act(1, f)?, g.act_poisoned(1, f, false)?);
    g.norm_glu(&xg, (&ng, 1e-5), &mut xn, (&wg.0, &wu.0), Activation::Silu, &mut gg, &mut ug, &mut sg)?;
    let (mut gc, mut uc, mut sc) = (c.act(1, f)?, c.act(1, f)?, c.act(1, f)?);
    c.norm_glu(&xc, (&norm, 1e-5), &mut xnc, (&wg.1, &wu.1), Activation::Silu, &mut gc, &mut uc, &mut sc)?;
    checks.check("1B norm→gate/up→SwiGLU", &g.read_rows(&sg, 0)?, &sc.data, 1e-2);
    let (cg, cu) = (copies(g, &wg.2, n)?, copies(g, &wu.2, n)?);
    let us = graph_time(g, 48, &mut |i| {
        let j = i % n;
        g.norm_glu(&xg, (&ng, 1e-5), &mut xn, (&cg[j], &cu[j]), Activation::Silu, &mut gg, &mut ug, &mut sg)
    })?;
    report("1B norm→gate/up 2×8192×2048 →SwiGLU", us, bytes(&[&wg.2, &wu.2]));

    // down: GEMV + residual add
    let wd = mat(g, r, d, f)?;
    let y = bf(&r.v(f, 1.0));
    let yg = g.act_from(1, f, &y)?;
    let mut rg = g.act_from_f32(1, d, &x)?;
    g.matmul_add(&yg, &wd.0, &mut rg, &mut tmp)?;
    let mut rc = xc.clone();
    c.matmul_add(&cpu(1, f, y), &wd.1, &mut rc, &mut tmpc)?;
    checks.check("1B down + residual", &delta(g.read_rows(&rg, 0)?), &delta(rc.data), 1e-2);
    let cd = copies(g, &wd.2, n)?;
    let us = graph_time(g, 48, &mut |i| g.matmul_add(&yg, &cd[i % n], &mut rg, &mut tmp))?;
    report("1B down 2048×8192 + add", us, bytes(&[&wd.2]));

    // A whole layer as the decode step runs it (norm→q/k/v, attention over 512 cached
    // positions with RoPE, o + add, norm→gate/up→SwiGLU, down + add), over `n` layers.
    {
        let (heads, n_kv, hd, pos) = (32, 8, 64, 512);
        let cfg = attn_cfg(heads, n_kv, hd, n, RopeStyle::Interleaved);
        let rope = Rope { inv_freq: cfg.rope_inv_freq(), style: RopeStyle::Interleaved, linear: 1.0 };
        let blocks = ferrolm::kv::blocks_for(&cfg, 640);
        let (mut kv, t) = (g.kv_store(&cfg, blocks)?, ferrolm::kv::InOrder::new(blocks));
        let mut att = g.act(1, d)?;
        let mut resid = g.act_from_f32(1, d, &x)?;
        g.begin(&[], &[t.span(pos, 1)], false)?;
        let us = graph_time(g, 48, &mut |i| {
            let j = i % n;
            let [q, k, v] = &mut og[..] else { unreachable!() };
            g.norm_matmul_many(&resid, &ng, 1e-5, &mut xn, &[&cq[j], &ck[j], &cv[j]], &mut [q, k, v])?;
            g.rope_attention(
                q,
                k,
                v,
                &mut kv,
                j,
                &[t.span(pos, 1)],
                &rope,
                (heads, n_kv),
                Attend::causal(hd),
                &mut att,
            )?;
            g.matmul_add(&att, &co[j], &mut resid, &mut tmp)?;
            g.norm_glu(&resid, (&ng, 1e-5), &mut xn, (&cg[j], &cu[j]), Activation::Silu, &mut gg, &mut ug, &mut sg)?;
            g.matmul_add(&sg, &cd[j], &mut resid, &mut tmp)
        })?;
        let layer_bytes = bytes(&[&wq.2, &wk.2, &wv.2, &wo.2, &wg.2, &wu.2, &wd.2]);
        report("1B whole layer (5 launches, 512 cached)", us, layer_bytes);
    }

    // final norm → head (f32 logits)
    let wh = mat(g, r, vocab, d)?;
    let mut hg = g.act_poisoned(1, vocab, true)?;
    g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wh.0], &mut [&mut hg])?;
    let mut hc = c.act(1, vocab)?;
    c.norm_matmul_many(&xc, &norm, 1e-5, &mut xnc, &[&wh.1], &mut [&mut hc])?;
    checks.check("1B norm→head", &g.read_rows(&hg, 0)?, &hc.data, 1e-2);
    let us = graph_time(g, 20, &mut |_| g.norm_matmul_many(&xg, &ng, 1e-5, &mut xn, &[&wh.0], &mut [&mut hg]))?;
    report("1B norm→head 128256×2048", us, bytes(&[&wh.2]));
    Ok(())
}

/// Decode attention at the 1B shape (32 query / 8 kv heads of 64) over 512 and 8191 cached
/// positions (caches sized as `ferrolm bench` sizes them): time per launch in a graph.
fn decode_attention(lab: &mut Session) -> Result<()> {
    let (g, n, r) = (lab.g, lab.copies, &mut lab.r);
    let (heads, n_kv, hd) = (32, 8, 64);
    let cfg = attn_cfg(heads, n_kv, hd, n, RopeStyle::Interleaved);
    let rope = Rope { inv_freq: cfg.rope_inv_freq(), style: RopeStyle::Interleaved, linear: 1.0 };
    for (pos, cache) in [(512, 640), (8191, 8320)] {
        let blocks = ferrolm::kv::blocks_for(&cfg, cache); // `n` layers: one per timed launch
        let (mut kv, t) = (g.kv_store(&cfg, blocks)?, ferrolm::kv::InOrder::new(blocks));
        let mut q = g.act_from(1, heads * hd, &bf(&r.v(heads * hd, 1.0)))?;
        let mut k = g.act_from(1, n_kv * hd, &bf(&r.v(n_kv * hd, 1.0)))?;
        let v = g.act_from(1, n_kv * hd, &bf(&r.v(n_kv * hd, 1.0)))?;
        let mut out = g.act(1, heads * hd)?;
        g.begin(&[], &[t.span(pos, 1)], false)?;
        let us = graph_time(g, 48, &mut |i| {
            g.rope_attention(
                &mut q,
                &mut k,
                &v,
                &mut kv,
                i % n,
                &[t.span(pos, 1)],
                &rope,
                (heads, n_kv),
                Attend::causal(hd),
                &mut out,
            )
        })?;
        let bytes = 2 * (pos + 1) * n_kv * hd * 2;
        println!(
            "1B decode attention at {pos} cached: {us:.2} µs per launch, {:.0} GB/s of K/V",
            bytes as f64 / us / 1e3
        );
    }
    Ok(())
}

/// Device top-k over a 128K vocabulary (the sampled step's last launch) and device argmax
/// (the greedy step's): time per launch in a graph. The argmax is checked against the
/// host's (ties to the lowest index).
fn decode_sampling(lab: &mut Session) -> Result<()> {
    let (g, r) = (lab.g, &mut lab.r);
    let vocab = 128256;
    let v = r.v(vocab, 10.0);
    let x = g.act_from_f32(1, vocab, &v)?;
    let mut am = g.act_poisoned(1, 1, true)?;
    g.argmax(&x, &mut am)?;
    let (got, want) = (g.read_rows(&am, 0)?[0], ferrolm::sample::argmax(&v));
    if !lab.checks.timing_only && got as u32 != want {
        lab.checks.failed.push(format!("argmax over {vocab}: {got}, want {want}"));
    }
    let us = graph_time(g, 48, &mut |_| g.argmax(&x, &mut am))?;
    println!("argmax over {vocab}: {us:.2} µs per launch");
    for k in [40, 1024] {
        let mut out = g.act_poisoned(1, 2 * k, true)?;
        let us = graph_time(g, 48, &mut |_| g.top_k(&x, k, 1.0 / 0.8, &mut out))?;
        println!("top-{k} over {vocab}: {us:.2} µs per launch");
    }
    Ok(())
}

/// Prefill attention of 512 rows at depth 0 and 8192, flash against the split-K attention
/// op, after checking flash against the CPU at depth 0.
fn flash_prefill(lab: &mut Session) -> Result<()> {
    let (g, c, r) = (lab.g, Cpu, &mut lab.r);
    for (heads, n_kv, hd) in [(9, 3, 64), (32, 8, 64)] {
        let cfg = attn_cfg(heads, n_kv, hd, 1, RopeStyle::Half);
        let (m, depths) = (512, [0usize, 8192]);
        let blocks = ferrolm::kv::blocks_for(&cfg, 8192 + m);
        let (mut kv, t) = (g.kv_store(&cfg, blocks)?, ferrolm::kv::InOrder::new(blocks));
        let (qv, kvv, vv) = (bf(&r.v(m * heads * hd, 1.0)), bf(&r.v(m * n_kv * hd, 1.0)), bf(&r.v(m * n_kv * hd, 1.0)));
        let q = g.act_from(m, heads * hd, &qv)?;
        let k = g.act_from(m, n_kv * hd, &kvv)?;
        let v = g.act_from(m, n_kv * hd, &vv)?;
        let mut out = g.act_poisoned(m, heads * hd, false)?;
        // Parity at depth 0: the split-K op writes the cache, flash reads it; the CPU
        // attends the same rows.
        g.begin(&[], &[t.span(0, m)], false)?;
        g.attention(&q, &k, &v, &mut kv, 0, &[t.span(0, m)], Attend::causal(hd), &mut out)?;
        g.flash_prefill(&q, &kv, 0, Attend::causal(hd), &mut out)?;
        let blocks_c = ferrolm::kv::blocks_for(&cfg, m);
        let (mut kvc, tc) = (c.kv_store(&cfg, blocks_c)?, ferrolm::kv::InOrder::new(blocks_c));
        let mut oc = c.act(m, heads * hd)?;
        let (qc, kc, vc) = (cpu(m, heads * hd, qv), cpu(m, n_kv * hd, kvv), cpu(m, n_kv * hd, vv));
        c.attention(&qc, &kc, &vc, &mut kvc, 0, &[tc.span(0, m)], Attend::causal(hd), &mut oc)?;
        lab.checks.check(
            &format!("flash_prefill {heads}/{n_kv}x{hd} m{m} pos0"),
            &g.read_rows(&out, 0)?,
            &oc.data,
            1e-2,
        );
        for pos in depths {
            let at = [t.span(pos, m)];
            g.begin(&[], &at, false)?;
            let split =
                stream_time(g, 20, &mut || g.attention(&q, &k, &v, &mut kv, 0, &at, Attend::causal(hd), &mut out))?;
            let flash = stream_time(g, 20, &mut || g.flash_prefill(&q, &kv, 0, Attend::causal(hd), &mut out))?;
            println!("attention {heads}/{n_kv}x{hd} m{m} pos{pos}: split-K {split:.3} ms, flash {flash:.3} ms");
        }
    }
    Ok(())
}

/// The tensor-core GEMM at prefill size (512 tokens): checked against the CPU at 2048 ×
/// 2048 (both output precisions), then its 64- and 128-token tiles timed beside the matmul
/// as configured at the 1B and 8B shapes' q/o, gate/up and down sizes
/// (tools/peers/cublas_gemm.py times dequantize-then-cuBLAS at the 1B ones).
fn qgemm(lab: &mut Session) -> Result<()> {
    use ferrolm::backend::cuda::QgemmKernel;
    let (g, c, r) = (lab.g, Cpu, &mut lab.r);
    let m = 512;
    let affine = |r: &mut Rng, n: usize, k: usize| {
        AffineTensor::quantize(&r.v(n * k, 0.05), n, k, 4, 64, ScaleDtype::F16).map(Weight::Affine)
    };
    {
        let (n, k) = (2048, 2048);
        let w = affine(r, n, k)?;
        let wg = g.matrix(w.clone())?;
        if !g.qgemm_supported(&wg) {
            lab.checks.failed.push(format!("qgemm refuses q4 g64 F16 n{n} k{k}"));
            return Ok(());
        }
        let x = bf(&r.v(m * k, 1.0));
        let xg = g.act_from(m, k, &x)?;
        let mut want = c.act(m, n)?;
        c.matmul(&cpu(m, k, x), &CpuMat::new(w.clone()), &mut want)?;
        for f32_out in [false, true] {
            let mut og = g.act_poisoned(m, n, f32_out)?;
            g.qgemm(&xg, &wg, &mut og)?;
            let what = format!("qgemm q4 g64 F16 n{n} k{k} m{m} f32out {f32_out}");
            lab.checks.check(&what, &g.read_rows(&og, 0)?, &want.data, 1e-2);
        }
    }
    for (n, k) in [(2048, 2048), (8192, 2048), (2048, 8192), (4096, 4096), (14336, 4096), (4096, 14336)] {
        let wg = g.matrix(affine(r, n, k)?)?;
        let xg = g.act_from(m, k, &bf(&r.v(m * k, 1.0)))?;
        let mut og = g.act_poisoned(m, n, false)?;
        let tg = stream_time(g, 20, &mut || g.qgemm_as(&xg, &wg, &mut og, QgemmKernel::Tiled))? / 1e3;
        let tw = stream_time(g, 20, &mut || g.qgemm_as(&xg, &wg, &mut og, QgemmKernel::Wide))? / 1e3;
        let tv = stream_time(g, 20, &mut || g.matmul(&xg, &wg, &mut og))? / 1e3;
        let flops = 2.0 * (m * n * k) as f64;
        let tf = |t: f64| flops / t / 1e12;
        println!(
            "q4 g64 m{m} n{n} k{k}: qgemm 64-token tiles {:.1} µs ({:.1} TFLOP/s), 128-token tiles {:.1} µs ({:.1} TFLOP/s), matmul as configured {:.1} µs ({:.1} TFLOP/s)",
            tg * 1e6,
            tf(tg),
            tw * 1e6,
            tf(tw),
            tv * 1e6,
            tf(tv)
        );
    }
    Ok(())
}

/// The wgmma GEMMs (issue 29's 8B prefill): the lab's forms (all threads loading,
/// dequantizing and multiplying, with or without a step's MMAs in flight) and the product's
/// `QgemmKernel::Wgmma` (a dequantized bf16 copy, then the dense ring), at 2048 × 2048
/// against the CPU, then at the 1B and 8B shapes their bits against the product's tiled
/// kernel (the same chunked arithmetic) and their times beside the product's mma.sync tiles
/// (Tiled, Wide), at 512 and 4096 tokens (4-bit, group 64, f16 scales, as `timings qgemm`).
/// The product's wgmma time includes its dequantization pass, whose own time follows.
fn wgmma_gemm(lab: &mut Session) -> Result<()> {
    use ferrolm::backend::cuda::QgemmKernel;
    use ferrolm_lab::wgmma::{qgemm_wg, WgForm};
    let (g, c, r) = (lab.g, Cpu, &mut lab.r);
    let affine = |r: &mut Rng, n: usize, k: usize| {
        AffineTensor::quantize(&r.v(n * k, 0.05), n, k, 4, 64, ScaleDtype::F16).map(Weight::Affine)
    };
    {
        let (m, n, k) = (300, 2048 + 64, 2048); // a partial token tile and a partial row tile
        let w = affine(r, n, k)?;
        let wg = g.matrix(w.clone())?;
        let x = bf(&r.v(m * k, 1.0));
        let xg = g.act_from(m, k, &x)?;
        let mut want = c.act(m, n)?;
        c.matmul(&cpu(m, k, x), &CpuMat::new(w), &mut want)?;
        for form in WgForm::ALL {
            for f32_out in [false, true] {
                let mut og = g.act_poisoned(m, n, f32_out)?;
                qgemm_wg(g, form, &xg, &wg, &mut og)?;
                let what = format!("qgemm_wg {form:?} q4 g64 F16 n{n} k{k} m{m} f32out {f32_out}");
                lab.checks.check(&what, &g.read_rows(&og, 0)?, &want.data, 1e-2);
            }
        }
    }
    for m in [512, 4096] {
        for (n, k) in [(2048, 2048), (8192, 2048), (2048, 8192), (4096, 4096), (14336, 4096), (4096, 14336)] {
            let wg = g.matrix(affine(r, n, k)?)?;
            let xg = g.act_from(m, k, &bf(&r.v(m * k, 1.0)))?;
            let mut ob = g.act_poisoned(m, n, true)?;
            g.qgemm_as(&xg, &wg, &mut ob, QgemmKernel::Tiled)?;
            let b = g.read_rows(&ob, 0)?;
            let mut og = g.act_poisoned(m, n, false)?;
            let tf = |t: f64| 2.0 * (m * n * k) as f64 / t / 1e12;
            let tp = stream_time(g, 20, &mut || g.qgemm_as(&xg, &wg, &mut og, QgemmKernel::Wide))? / 1e3;
            print!("q4 g64 m{m} n{n} k{k}: product Wide {:.1} µs ({:.1} TFLOP/s)", tp * 1e6, tf(tp));
            let mut run = |name: String, f: &mut dyn FnMut(&mut CudaAct) -> Result<()>| -> Result<()> {
                let mut oa = g.act_poisoned(m, n, true)?;
                f(&mut oa)?;
                let a = g.read_rows(&oa, 0)?;
                let same = a.iter().zip(&b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
                let err = ferrolm_lab::timing::rel_err(&a, &b);
                let tw = stream_time(g, 20, &mut || f(&mut og))? / 1e3;
                print!(
                    "; {name} {:.1} µs ({:.1} TFLOP/s, {:.3}x), bits equal to the tiled kernel's {same}/{} (rel. diff {err:.2e})",
                    tw * 1e6,
                    tf(tw),
                    tp / tw,
                    a.len()
                );
                Ok(())
            };
            run("product Tiled".into(), &mut |o| g.qgemm_as(&xg, &wg, o, QgemmKernel::Tiled))?;
            run("product Wgmma".into(), &mut |o| g.qgemm_as(&xg, &wg, o, QgemmKernel::Wgmma))?;
            for form in WgForm::ALL {
                run(format!("{form:?}"), &mut |o| qgemm_wg(g, form, &xg, &wg, o))?;
            }
            let mut copy = g.zeros::<u16>(n * k, "the lab's weight copy")?;
            let td = stream_time(g, 20, &mut || g.wgmma_dequant_into(&wg, &mut copy))? / 1e3;
            print!("; its dequantization {:.1} µs", td * 1e6);
            println!();
        }
    }
    Ok(())
}

/// The few-token GEMM at the token counts of serving calls, on the 1B and 8B shapes (4-bit,
/// group 64, bf16 scales): the same bits as the tiled kernel first, then each kernel's time
/// per launch in a captured graph cycling over weight copies (HBM, not L2), with the GEMV
/// path (one row a block below 16 tokens, else the tiled GEMM) beside them.
fn few_token_gemm(lab: &mut Session) -> Result<()> {
    use ferrolm::backend::cuda::QgemmKernel;
    let (g, r, n) = (lab.g, &mut lab.r, lab.copies);
    let shapes = [("1B q/o", 2048, 2048), ("1B gate", 8192, 2048), ("1B down", 2048, 8192)];
    let shapes_8b = [("8B q/o", 4096, 4096), ("8B gate", 14336, 4096), ("8B down", 4096, 14336)];
    for (name, rows, cols) in shapes.into_iter().chain(shapes_8b) {
        let (wg, _, w) = mat(g, r, rows, cols)?;
        let co = copies(g, &w, n)?;
        for m in [1, 4, 16, 32, 64] {
            let xg = g.act_from(m, cols, &bf(&r.v(m * cols, 1.0)))?;
            let mut out = g.act_poisoned(m, rows, false)?;
            let mut run = |k| -> Result<Vec<u32>> {
                g.qgemm_as(&xg, &wg, &mut out, k)?;
                Ok(g.read_rows(&out, 0)?.iter().map(|v| v.to_bits()).collect())
            };
            if run(QgemmKernel::Tiled)? != run(QgemmKernel::Small)? {
                lab.checks.failed.push(format!("{name} m{m}: few-token bits differ from the tiled kernel's"));
            }
            let mut time = |k: Option<QgemmKernel>| {
                graph_time(g, 48, &mut |i| match k {
                    Some(k) => g.qgemm_as(&xg, &co[i % n], &mut out, k),
                    None => g.matmul(&xg, &co[i % n], &mut out),
                })
            };
            let (small, tiled, gemv) = (time(Some(QgemmKernel::Small))?, time(Some(QgemmKernel::Tiled))?, time(None)?);
            let gbs = |us: f64| w.byte_size() as f64 / us / 1e3;
            // The fraction of the H200's measured bf16 dense matmul rate (GPU-FACTS.md: 790
            // TFLOP/s at 8192³ in PyTorch) the few-token kernel's tensor work reaches.
            let bf16_share = 2.0 * (m * rows * cols) as f64 / (small * 1e-6) / BF16_DENSE_FLOPS;
            println!(
                "{name} {rows}×{cols} m{m}: few-token {small:.2} µs ({:.0} GB/s, {:.1}% of bf16 dense), tiled {tiled:.2} µs ({:.0} GB/s), GEMV path {gemv:.2} µs",
                gbs(small),
                100.0 * bf16_share,
                gbs(tiled)
            );
        }
    }
    Ok(())
}

/// The lab's batched decode GEMVs at the 1B and 8B shapes (4-bit, group 64, bf16 scales):
/// on DP2A (kernels/bgemv.cuh, 1 to 8 tokens a block) and on integer MMAs
/// (kernels/bgemv_mma.cu, 1 to 4 tiles of 8 tokens a warp, its x quantization included).
/// Five tokens' outputs against the product GEMV run on each token alone, which must be
/// the same bits; then each one's time per launch at 1 to 64 tokens beside the serving
/// path's two GEMMs, in captured graphs cycling over weight copies.
fn batched_gemv(lab: &mut Session) -> Result<()> {
    use ferrolm::backend::cuda::QgemmKernel;
    use ferrolm_lab::bgemv::{bgemv, bgemv_mma, staged_bytes, QuantX};
    let (g, r, n) = (lab.g, &mut lab.r, lab.copies);
    let optin = ferrolm_lab::Lab::new(g)?.smem_optin;
    let shapes = [
        ("1B q/o", 2048, 2048),
        ("1B gate", 8192, 2048),
        ("1B down", 2048, 8192),
        ("8B q/o", 4096, 4096),
        ("8B gate", 14336, 4096),
        ("8B down", 4096, 14336),
    ];
    for (name, rows, cols) in shapes {
        let (wg, _, w) = mat(g, r, rows, cols)?;
        let m = 5;
        let xv = bf(&r.v(m * cols, 1.0));
        let xg5 = g.act_from(m, cols, &xv)?;
        let mut want = Vec::with_capacity(m * rows);
        for x in xv.chunks(cols) {
            let mut one = g.act_poisoned(1, rows, true)?;
            g.matmul(&g.act_from(1, cols, x)?, &wg, &mut one)?;
            want.extend(g.read_rows(&one, 0)?);
        }
        let mut out = g.act_poisoned(m, rows, true)?;
        bgemv(g, &xg5, &wg, &mut out, 4, optin)?;
        let mut q5 = QuantX::new(g, m, cols, 1)?;
        let mut out_mma = g.act_poisoned(m, rows, true)?;
        bgemv_mma(g, &xg5, &wg, &mut out_mma, &mut q5, 1)?;
        for (kernel, got) in [("bgemv", g.read_rows(&out, 0)?), ("bgemv_mma", g.read_rows(&out_mma, 0)?)] {
            let equal = got.iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
            let said = format!("{kernel} {name}: {equal} of {} outputs have the GEMV's bits", m * rows);
            println!("{said}");
            if equal != m * rows && !lab.checks.timing_only {
                lab.checks.failed.push(said);
            }
        }
        let co = copies(g, &w, n)?;
        for m in [1, 4, 8, 16, 32, 64] {
            let xg = g.act_from(m, cols, &bf(&r.v(m * cols, 1.0)))?;
            let (mut of, mut ob) = (g.act_poisoned(m, rows, true)?, g.act_poisoned(m, rows, false)?);
            let mut line = format!("{name} {rows}×{cols} m{m}:");
            for nt in [1, 2, 4, 8] {
                if nt > m || nt * staged_bytes(cols) > optin {
                    continue;
                }
                let us = graph_time(g, 48, &mut |i| bgemv(g, &xg, &co[i % n], &mut of, nt, optin))?;
                let rate = (m * rows * cols) as f64 / us / 1e6;
                line += &format!(" bgemv/{nt} {us:.2} µs ({rate:.1} T multiply-adds/s);");
            }
            for tt in [1, 2, 4] {
                if 8 * tt > m.max(8) {
                    continue;
                }
                let mut q = QuantX::new(g, m, cols, tt)?;
                let us = graph_time(g, 48, &mut |i| bgemv_mma(g, &xg, &co[i % n], &mut of, &mut q, tt))?;
                let rate = (m * rows * cols) as f64 / us / 1e6;
                line += &format!(" mma/{tt} {us:.2} µs ({rate:.1} T);");
            }
            let mut time = |k| graph_time(g, 48, &mut |i| g.qgemm_as(&xg, &co[i % n], &mut ob, k));
            let (small, tiled) = (time(QgemmKernel::Small)?, time(QgemmKernel::Tiled)?);
            println!("{line} serving GEMMs: few-token {small:.2} µs, tiled {tiled:.2} µs");
        }
    }
    Ok(())
}
