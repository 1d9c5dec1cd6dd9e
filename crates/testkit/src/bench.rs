//! What the benchmarks among the examples share: their arguments and their summaries.

use std::str::FromStr;

/// The median of `v` (the upper one of an even count); `v` must not be empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Takes `flag VALUE` out of `args`: the value, or `None` where the flag is not given; a
/// flag without a value it can parse ends the run saying so.
pub fn take_flag<T: FromStr>(args: &mut Vec<String>, flag: &str) -> Option<T> {
    let i = args.iter().position(|a| a == flag)?;
    let value = args
        .get(i + 1)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("{flag} takes a value"));
    args.drain(i..i + 2);
    Some(value)
}

/// `args` as numbers (positional arguments, after [`take_flag`] took the flags).
pub fn numbers(args: &[String]) -> Vec<usize> {
    args.iter()
        .map(|a| {
            a.parse()
                .unwrap_or_else(|_| panic!("{a:?} is not a number"))
        })
        .collect()
}

/// The program's arguments, after its name.
pub fn args() -> Vec<String> {
    std::env::args().skip(1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_come_out_and_numbers_stay() {
        let mut a: Vec<String> = ["64", "--tp", "2", "3"].map(String::from).to_vec();
        assert_eq!(take_flag::<usize>(&mut a, "--tp"), Some(2));
        assert_eq!(take_flag::<usize>(&mut a, "--tp"), None);
        assert_eq!(numbers(&a), [64, 3]);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0]), 4.0);
    }
}
