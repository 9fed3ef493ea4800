//! SPM on a hand-made vocabulary. Every expected id list is worked out by hand from the merge
//! rule (highest score first, leftmost on ties) in the comment beside it.

use super::*;

const UNK: u32 = 0;
const BOS: u32 = 1;
const EOS: u32 = 2;
/// `<0xHH>` is id `BYTE0 + HH`.
const BYTE0: u32 = 3;
const SP: u32 = 259; // ▁
const A: u32 = 260; // a
const B: u32 = 261; // b
const SP_A: u32 = 262; // ▁a
const AB: u32 = 263; // ab
const SP_AB: u32 = 264; // ▁ab
const START: u32 = 265; // <start>, control
const NL2: u32 = 266; // "\n\n", user-defined
const AA: u32 = 267; // aa
const EOT: u32 = 268; // <end_of_turn>, control

fn spec(add_space_prefix: bool) -> TokenizerSpec {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut scores = vec![0.0, 0.0, 0.0];
    let mut types = vec![TokenType::Unknown, TokenType::Control, TokenType::Control];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(TokenType::Byte);
    }
    for (t, s, ty) in [
        ("▁", -1.0, TokenType::Normal),
        ("a", -2.0, TokenType::Normal),
        ("b", -3.0, TokenType::Normal),
        ("▁a", -1.5, TokenType::Normal),
        ("ab", -0.5, TokenType::Normal),
        ("▁ab", -0.25, TokenType::Normal),
        ("<start>", 0.0, TokenType::Control),
        ("\n\n", 0.0, TokenType::UserDefined),
        ("aa", -1.0, TokenType::Normal),
        ("<end_of_turn>", 0.0, TokenType::Control),
    ] {
        tokens.push(t.to_string());
        scores.push(s);
        types.push(ty);
    }
    TokenizerSpec {
        model: TokenizerModel::Llama,
        tokens,
        scores,
        token_types: types,
        merges: Vec::new(),
        bos: Some(BOS),
        eos: Some(EOS),
        eot: None,
        unk: Some(UNK),
        pad: None,
        add_bos: true,
        add_eos: false,
        add_space_prefix,
        pre: None,
    }
}

fn tok(add_space_prefix: bool) -> Tokenizer {
    Tokenizer::new(spec(add_space_prefix)).expect("valid vocabulary")
}

fn byte(b: u8) -> u32 {
    BYTE0 + u32::from(b)
}

fn check(t: &Tokenizer, text: &str, parse_special: bool, expect: &[u32]) {
    let got = t.encode(text, true, parse_special).expect("encode");
    assert_eq!(
        got, expect,
        "encoding {text:?} (parse_special {parse_special})"
    );
}

#[test]
fn best_score_merges_first() {
    // "▁ab": pairs ▁a (-1.5) and ab (-0.5); ab wins, then ▁+ab = ▁ab (-0.25).
    check(&tok(true), "ab", false, &[BOS, SP_AB]);
    // Without the prefix only ab itself.
    check(&tok(false), "ab", false, &[BOS, AB]);
}

#[test]
fn unmergeable_symbols_stay_single() {
    // "▁ba": neither ▁b nor ba is a token.
    check(&tok(true), "ba", false, &[BOS, SP, B, A]);
}

#[test]
fn equal_scores_merge_leftmost_first() {
    // "▁aaa": aa@1 and aa@2 both score -1 (above ▁a's -1.5); the left one merges, which makes
    // aa@2 and ▁a stale: ▁ aa a. Merging the right one first would give ▁a aa.
    check(&tok(true), "aaa", false, &[BOS, SP, AA, A]);
}

#[test]
fn unknown_characters_fall_back_to_bytes() {
    // é is not a token: its UTF-8 bytes C3 A9 as <0xC3> <0xA9>.
    check(&tok(true), "é", false, &[BOS, SP, byte(0xC3), byte(0xA9)]);
    // Without the space prefix, a space is ▁ all the same.
    check(&tok(false), "b a", false, &[BOS, B, SP_A]);
}

#[test]
fn control_tokens_need_parse_special() {
    let t = tok(true);
    // Cut out: "a", <start>, "b"; the text after a special token gets the space prefix again.
    check(&t, "a<start>b", true, &[BOS, SP_A, START, SP, B]);
    // Plain text: ▁a merges, every other character of "<start>" but 'a' is a byte token.
    check(
        &t,
        "a<start>b",
        false,
        &[
            BOS,
            SP_A,
            byte(b'<'),
            byte(b's'),
            byte(b't'),
            A,
            byte(b'r'),
            byte(b't'),
            byte(b'>'),
            B,
        ],
    );
    // A literal BOS only with parse_special.
    check(&t, "<s>", true, &[BOS, BOS]);
}

#[test]
fn user_defined_tokens_are_always_cut_out() {
    check(&tok(true), "a\n\nb", false, &[BOS, SP_A, NL2, SP, B]);
    check(&tok(false), "a\n\n", false, &[BOS, A, NL2]);
}

#[test]
fn empty_text() {
    let t = tok(true);
    assert_eq!(t.encode("", true, true).expect("encode"), vec![BOS]);
    assert_eq!(
        t.encode("", false, true).expect("encode"),
        Vec::<u32>::new()
    );
}

#[test]
fn add_special_off_adds_nothing() {
    assert_eq!(
        tok(true).encode("ab", false, false).expect("encode"),
        vec![SP_AB]
    );
}

#[test]
fn decode_undoes_encode() {
    let t = tok(true);
    for text in ["ab", "ba a", "é", "  ", ""] {
        let ids = t.encode(text, true, false).expect("encode");
        assert_eq!(t.decode(&ids), text, "ids {ids:?}");
    }
    // With a space prefix, llama.cpp also prefixes the text after a special token, so that
    // space comes back; without the prefix (Gemma) the round trip is exact.
    let ids = t.encode("a\n\nb", true, false).expect("encode");
    assert_eq!(t.decode(&ids), "a\n\n b");
    let t = tok(false);
    let ids = t.encode("a\n\nb", true, false).expect("encode");
    assert_eq!(t.decode(&ids), "a\n\nb");
    // Control tokens decode to nothing, or to their text when asked.
    assert_eq!(t.decode(&[BOS, START, A, EOS]), "a");
    assert_eq!(t.token_bytes_special(START, true), b"<start>");
    assert_eq!(t.token_piece(SP_AB), "▁ab");
    assert_eq!(t.token_bytes(SP_AB), b" ab");
    assert_eq!(t.token_bytes(byte(0x0A)), b"\n");
    assert_eq!(t.token_bytes(9999), b"");
}

#[test]
fn stream_decoder_holds_incomplete_utf8() {
    let t = tok(false);
    let mut d = t.stream_decoder();
    assert_eq!(d.push(byte(0xC3)), "");
    assert_eq!(d.pending(), &[0xC3]);
    assert_eq!(d.push(byte(0xA9)), "é");
    assert_eq!(d.push(A), "a");
    // An invalid byte is replaced exactly as a lossy decode does it.
    assert_eq!(d.push(byte(0xFF)), "\u{FFFD}");
    assert_eq!(d.push(byte(0xE2)), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

#[test]
fn eog_and_specials() {
    let t = tok(true);
    assert!(t.is_eog(EOS));
    // <end_of_turn> is found by name as the end-of-turn token.
    assert_eq!(t.eot(), Some(EOT));
    assert!(t.is_eog(EOT));
    assert!(!t.is_eog(BOS));
    assert_eq!(t.vocab_size(), 269);
    assert_eq!(t.bos(), Some(BOS));
    assert_eq!(t.eos(), Some(EOS));
}

#[test]
fn missing_byte_token_is_an_error() {
    let mut s = spec(true);
    // Drop the <0xC3> token's byte type and text so byte fallback cannot find it.
    let i = byte(0xC3) as usize;
    s.tokens[i] = "x".into();
    s.token_types[i] = TokenType::Normal;
    let t = Tokenizer::new(s).expect("valid vocabulary");
    assert!(matches!(
        t.encode("é", false, false),
        Err(TokenizerError::NoByteToken { byte: 0xC3 })
    ));
}

#[test]
fn bad_vocabularies_are_errors() {
    let mut s = spec(true);
    s.bos = Some(5000);
    assert!(matches!(
        Tokenizer::new(s),
        Err(TokenizerError::IdOutOfRange { id: 5000, .. })
    ));
    let mut s = spec(true);
    s.scores.truncate(3);
    assert!(matches!(
        Tokenizer::new(s),
        Err(TokenizerError::LengthMismatch { found: 3, .. })
    ));
    let mut s = spec(true);
    s.tokens[3] = "<0xZZ>".into();
    assert!(matches!(
        Tokenizer::new(s),
        Err(TokenizerError::BadByteToken { id: 3, .. })
    ));
    let mut s = spec(true);
    s.tokens.clear();
    assert!(matches!(Tokenizer::new(s), Err(TokenizerError::EmptyVocab)));
}
