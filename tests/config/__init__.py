"""Tests of zeroshard/config/."""
