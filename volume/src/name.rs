//! Validation of volume and snapshot names.
//!
//! Names become file names under `ROOT/volumes/`, so they must never reach
//! outside it: no `/`, no `.` or `..`, and no leading `.` (which the engine
//! keeps for its own temporary files, so a user name can never collide with
//! one).

/// The longest accepted name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Why a name was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("the name is empty")]
    Empty,
    #[error("the name is longer than {MAX_NAME_LEN} bytes")]
    TooLong,
    #[error("the name must start with a letter or a digit")]
    BadStart,
    #[error("the name contains '/'; names are single path components")]
    Slash,
    #[error("the name contains '..'")]
    DotDot,
    #[error("the name contains {0:?}; use letters, digits, '.', '_' and '-'")]
    BadChar(char),
    #[error("the name is reserved: `/v1/volumes/import` is the import route")]
    Reserved,
}

/// Check that `name` is a valid volume or snapshot name: 1 to
/// [`MAX_NAME_LEN`] bytes of `[A-Za-z0-9._-]`, starting with a letter or a
/// digit, without `..`.
pub fn validate(name: &str) -> Result<(), NameError> {
    let first = name.chars().next().ok_or(NameError::Empty)?;
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong);
    }
    if name.contains('/') {
        return Err(NameError::Slash);
    }
    if name.contains("..") {
        return Err(NameError::DotDot);
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(NameError::BadChar(c));
    }
    if !first.is_ascii_alphanumeric() {
        return Err(NameError::BadStart);
    }
    if name == "import" {
        return Err(NameError::Reserved);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names() {
        for n in ["a", "vol0", "db-data_1.img", "0", &"x".repeat(MAX_NAME_LEN)] {
            assert_eq!(validate(n), Ok(()), "{n}");
        }
    }

    #[test]
    fn refuses_names_that_escape_or_hide() {
        assert_eq!(validate(""), Err(NameError::Empty));
        assert_eq!(validate("a/b"), Err(NameError::Slash));
        assert_eq!(validate("/etc"), Err(NameError::Slash));
        assert_eq!(validate(".."), Err(NameError::DotDot));
        assert_eq!(validate("a..b"), Err(NameError::DotDot));
        assert_eq!(validate("."), Err(NameError::BadStart));
        assert_eq!(validate(".hidden"), Err(NameError::BadStart));
        assert_eq!(validate("-rf"), Err(NameError::BadStart));
        assert_eq!(validate("a b"), Err(NameError::BadChar(' ')));
        assert_eq!(validate("a\0"), Err(NameError::BadChar('\0')));
        assert_eq!(validate("é"), Err(NameError::BadChar('é')));
        assert_eq!(validate("import"), Err(NameError::Reserved));
        assert_eq!(
            validate(&"x".repeat(MAX_NAME_LEN + 1)),
            Err(NameError::TooLong)
        );
    }
}
