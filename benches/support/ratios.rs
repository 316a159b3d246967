//! Per-round ratios printed as their median and range, for the benchmarks that run in rounds.

/// Prints `label: per round median M, range LOW..HIGH` of `ratios` (`n/a` if there are none).
pub fn ratio_line(label: &str, mut ratios: Vec<f64>) {
    if ratios.is_empty() {
        return println!("{label}: n/a");
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "{label}: per round median {:.2}x, range {:.2}x..{:.2}x",
        ratios[ratios.len() / 2],
        ratios[0],
        ratios[ratios.len() - 1]
    );
}
