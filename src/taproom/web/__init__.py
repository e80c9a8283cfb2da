"""Operations endpoints and live views."""
