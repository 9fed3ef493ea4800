//! Checks on a compiled cubin (its ELF header names the architecture it runs on) and the ptxas
//! report NVRTC leaves in the program log (`-Xptxas -v`).

/// ELF `e_machine` of NVIDIA GPU code.
const EM_CUDA: u16 = 190;

/// The architecture (`major × 10 + minor`) a cubin was built for, read from its ELF header.
///
/// CUDA ELF files put the SM version in `e_flags`: in the low byte for ELF ABI version 7 (the
/// layout NVRTC 12 writes for sm_80 … sm_90) and in bits 8–15 for ABI version 8 (sm_100 and
/// newer).
pub fn cubin_arch(cubin: &[u8]) -> Result<u32, String> {
    if cubin.len() < 64 || &cubin[..4] != b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    if cubin[4] != 2 || cubin[5] != 1 {
        return Err(format!(
            "expected a 64-bit little-endian ELF, found class {} data {}",
            cubin[4], cubin[5]
        ));
    }
    let machine = u16::from_le_bytes([cubin[18], cubin[19]]);
    if machine != EM_CUDA {
        return Err(format!(
            "expected e_machine {EM_CUDA} (CUDA), found {machine}"
        ));
    }
    let flags = u32::from_le_bytes([cubin[48], cubin[49], cubin[50], cubin[51]]);
    match cubin[8] {
        7 => Ok(flags & 0xff),
        8 => Ok((flags >> 8) & 0xff),
        v => Err(format!(
            "unknown CUDA ELF ABI version {v} (e_flags {flags:#x})"
        )),
    }
}

/// What ptxas reports for one kernel entry point.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelStats {
    pub name: String,
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// Static shared memory in bytes (dynamic shared memory is sized at launch).
    pub shared_bytes: u32,
    pub stack_bytes: u32,
}

/// Parse the `-Xptxas -v` report:
///
/// ```text
/// ptxas info    : Compiling entry function 'rms_norm' for 'sm_90'
/// ptxas info    : Function properties for rms_norm
/// ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 25 registers, used 1 barriers, 256 bytes smem
/// ```
pub fn parse_ptxas(log: &str) -> Vec<KernelStats> {
    let mut out: Vec<KernelStats> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelStats {
                name,
                ..KernelStats::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else {
            continue;
        };
        if line.contains("bytes stack frame") {
            cur.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains("registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
            cur.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

/// The integer just before `marker` in `line` (`... 25 registers` → 25).
fn number_before(line: &str, marker: &str) -> Option<u32> {
    let head = &line[..line.find(marker)?];
    head.split(|c: char| !c.is_ascii_digit())
        .rfind(|s| !s.is_empty())?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_ptxas_report_of_each_entry() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'rope' for 'sm_90'\n\
ptxas info    : Function properties for rope\n\
ptxas         .     32 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 28 registers, used 0 barriers, 32 bytes cumulative stack size\n\
ptxas info    : Compiling entry function 'rms_norm' for 'sm_90'\n\
ptxas info    : Function properties for rms_norm\n\
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 25 registers, used 1 barriers, 256 bytes smem\n";
        let s = parse_ptxas(log);
        assert_eq!(s.len(), 2);
        assert_eq!(
            s[0],
            KernelStats {
                name: "rope".into(),
                registers: 28,
                spill_stores: 8,
                spill_loads: 4,
                shared_bytes: 0,
                stack_bytes: 32
            }
        );
        assert_eq!(
            (s[1].name.as_str(), s[1].registers, s[1].shared_bytes),
            ("rms_norm", 25, 256)
        );
    }

    /// A 64-byte ELF header with the given ABI version and flags.
    fn header(abi: u8, machine: u16, flags: u32) -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = 2;
        h[5] = 1;
        h[8] = abi;
        h[18..20].copy_from_slice(&machine.to_le_bytes());
        h[48..52].copy_from_slice(&flags.to_le_bytes());
        h
    }

    #[test]
    fn reads_the_arch_of_both_elf_layouts() {
        // e_flags as NVRTC 12.9 writes them (read from real cubins of a one-line kernel).
        assert_eq!(cubin_arch(&header(7, 190, 0x5a055a)), Ok(90));
        assert_eq!(cubin_arch(&header(7, 190, 0x500550)), Ok(80));
        assert_eq!(cubin_arch(&header(8, 190, 0x6006702)), Ok(103));
        assert_eq!(cubin_arch(&header(8, 190, 0x6007802)), Ok(120));
        assert!(cubin_arch(&header(7, 62, 0x5a055a)).is_err_and(|e| e.contains("e_machine")));
        assert!(cubin_arch(b"PTX").is_err());
    }
}
